// The list scheduler of tagps.strategy.simulator: the virtual runtime's inner loop, which the tree search
// runs thousands of times per plan search (the Python graph builder hands it one step's tasks).
#pragma once

#include <cstdint>
#include <vector>

namespace tagps::sim {

// The tasks of one training step in creation order: a task's predecessors were created before it.
struct StepTasks {
  std::vector<double> duration;        // seconds
  std::vector<int32_t> resource_begin;  // n + 1 offsets: task t holds resources[begin[t], begin[t + 1])
  std::vector<int32_t> resources;
  std::vector<int32_t> pred_begin;  // n + 1 offsets into preds
  std::vector<int32_t> preds;
};

// In every step after the first, `task` also waits for the previous step's `prereq`.
struct StepWait {
  int32_t task;
  int32_t prereq;
};

// Per task of all steps (step k's task t at k * n + t): start and finish; per resource: busy seconds.
struct Timeline {
  std::vector<double> start, finish, busy;
};

// Schedules `steps` copies of `tasks` on `num_resources` resources. A task starts when its predecessors are
// done and all its resources are free; resources serve tasks in the order they become ready, events leave
// a heap of (finish time, task index), so ties resolve by creation order. Throws InvalidArgument on
// malformed input: a predecessor that is not an earlier task, a resource or wait out of range.
Timeline list_schedule(const StepTasks& tasks, int steps, const std::vector<StepWait>& waits,
                       int num_resources);

}  // namespace tagps::sim
