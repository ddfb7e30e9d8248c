#include "sim/schedule.h"

#include <cstddef>
#include <functional>
#include <queue>
#include <utility>

#include "common/error.h"

namespace tagps::sim {
namespace {

// Compressed rows: row r is items[begin[r], begin[r + 1]).
struct Rows {
  std::vector<int32_t> begin, items;
};

// Rows 0..n-1 filled from the (row, item) pairs that `edges(emit)` emits (`count` of them), each row in
// emission order.
template <typename Edges>
Rows rows(size_t n, size_t count, const Edges& edges) {
  Rows out{std::vector<int32_t>(n + 1, 0), std::vector<int32_t>(count)};
  edges([&](int32_t row, int32_t) { ++out.begin[row + 1]; });
  for (size_t r = 0; r < n; ++r) out.begin[r + 1] += out.begin[r];
  std::vector<int32_t> next(out.begin.begin(), out.begin.end() - 1);
  edges([&](int32_t row, int32_t item) { out.items[next[row]++] = item; });
  return out;
}

// Successors of one step's tasks, each row in the order its successors were created (the order in which
// a finished task releases them, which decides who gets a contended resource first).
Rows successors(const StepTasks& s) {
  return rows(s.duration.size(), s.preds.size(), [&](const auto& emit) {
    for (size_t t = 0; t < s.duration.size(); ++t) {
      for (int32_t k = s.pred_begin[t]; k < s.pred_begin[t + 1]; ++k) {
        emit(s.preds[k], static_cast<int32_t>(t));
      }
    }
  });
}

// The tasks of the next step that each task releases, in the order of `waits`.
Rows wait_successors(size_t n, const std::vector<StepWait>& waits) {
  return rows(n, waits.size(), [&](const auto& emit) {
    for (const StepWait& w : waits) emit(w.prereq, w.task);
  });
}

void check(const StepTasks& s, const std::vector<StepWait>& waits, int steps, int num_resources) {
  const size_t n = s.duration.size();
  TAGPS_ENFORCE_GE(steps, 1, "steps");
  TAGPS_ENFORCE_GE(num_resources, 0, "num_resources");
  TAGPS_ENFORCE_EQ(s.resource_begin.size(), n + 1, "resource offsets");
  TAGPS_ENFORCE_EQ(s.pred_begin.size(), n + 1, "predecessor offsets");
  TAGPS_ENFORCE(s.resource_begin[0] == 0 && s.pred_begin[0] == 0, "offsets must start at 0");
  TAGPS_ENFORCE_EQ(static_cast<size_t>(s.resource_begin[n]), s.resources.size(), "resource offsets");
  TAGPS_ENFORCE_EQ(static_cast<size_t>(s.pred_begin[n]), s.preds.size(), "predecessor offsets");
  for (size_t t = 0; t < n; ++t) {
    TAGPS_ENFORCE(s.resource_begin[t] <= s.resource_begin[t + 1] && s.pred_begin[t] <= s.pred_begin[t + 1],
                  "offsets must not decrease (task ", t, ")");
    for (int32_t k = s.pred_begin[t]; k < s.pred_begin[t + 1]; ++k) {
      TAGPS_ENFORCE(s.preds[k] >= 0 && static_cast<size_t>(s.preds[k]) < t, "task ", t, " waits for task ",
                    s.preds[k], ", which is not an earlier task");
    }
  }
  for (int32_t r : s.resources) TAGPS_ENFORCE(r >= 0 && r < num_resources, "resource ", r, " out of range");
  for (const StepWait& w : waits) {
    TAGPS_ENFORCE(w.task >= 0 && static_cast<size_t>(w.task) < n && w.prereq >= 0 &&
                      static_cast<size_t>(w.prereq) < n,
                  "wait (", w.task, ", ", w.prereq, ") names a task out of range");
  }
}

}  // namespace

Timeline list_schedule(const StepTasks& s, int steps, const std::vector<StepWait>& waits, int num_resources) {
  check(s, waits, steps, num_resources);
  const int64_t n = static_cast<int64_t>(s.duration.size());
  const int64_t total = n * steps;
  const Rows succ = successors(s);
  const Rows next_step = wait_successors(n, waits);

  std::vector<int32_t> pending(total);
  for (int64_t k = 0; k < steps; ++k) {
    for (int64_t t = 0; t < n; ++t) pending[k * n + t] = s.pred_begin[t + 1] - s.pred_begin[t];
    if (k) {
      for (const StepWait& w : waits) ++pending[k * n + w.task];
    }
  }

  Timeline out{std::vector<double>(total, 0.0), std::vector<double>(total, 0.0),
               std::vector<double>(num_resources, 0.0)};
  std::vector<double> free_at(num_resources, 0.0);
  using Event = std::pair<double, int64_t>;  // (finish time, task): the smaller task wins a tie
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;

  // Task u is ready at `at`: it starts when all its resources are free too, and holds them all.
  const auto release = [&](int64_t u, double at) {
    const int64_t t = u % n;
    double begin = at;
    for (int32_t k = s.resource_begin[t]; k < s.resource_begin[t + 1]; ++k) {
      if (free_at[s.resources[k]] > begin) begin = free_at[s.resources[k]];
    }
    const double d = s.duration[t];
    const double end = begin + d;
    for (int32_t k = s.resource_begin[t]; k < s.resource_begin[t + 1]; ++k) {
      free_at[s.resources[k]] = end;
      out.busy[s.resources[k]] += d;
    }
    out.start[u] = begin;
    out.finish[u] = end;
    events.emplace(end, u);
  };

  for (int64_t u = 0; u < total; ++u) {
    if (pending[u] == 0) release(u, 0.0);
  }
  // check() let each task wait only for earlier tasks of its step and for the previous step: a DAG, so
  // every task is released once all its predecessors have left the heap.
  while (!events.empty()) {
    const auto [at, u] = events.top();
    events.pop();
    const int64_t step = u / n, t = u % n, base = step * n;
    for (int32_t k = succ.begin[t]; k < succ.begin[t + 1]; ++k) {
      if (--pending[base + succ.items[k]] == 0) release(base + succ.items[k], at);
    }
    if (step + 1 < steps) {
      for (int32_t k = next_step.begin[t]; k < next_step.begin[t + 1]; ++k) {
        if (--pending[base + n + next_step.items[k]] == 0) release(base + n + next_step.items[k], at);
      }
    }
  }
  return out;
}

}  // namespace tagps::sim
