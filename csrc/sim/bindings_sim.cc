// Python names of the simulator's list scheduler (csrc/sim), registered into tagps._core.
#include <pybind11/stl.h>

#include <climits>
#include <utility>
#include <vector>

#include "bind_modules.h"
#include "common/error.h"
#include "sim/schedule.h"

namespace py = pybind11;

namespace tagps {
namespace {

// The conversions read the lists through CPython's API: the search hands over about a thousand items per
// plan, and pybind11's per-item casters would cost as much as the schedule itself.
int32_t as_int32(PyObject* item, const char* what) {
  const long v = PyLong_AsLong(item);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  TAGPS_ENFORCE(v >= INT32_MIN && v <= INT32_MAX, what, " ", v, " out of range");
  return static_cast<int32_t>(v);
}

PyObject* tuple_item(PyObject* item, const char* what) {
  if (!PyTuple_Check(item)) throw InvalidType(detail::concat(what, " must be tuples"));
  return item;
}

sim::StepTasks step_tasks(const py::list& durations, const py::list& resources, const py::list& pred_counts,
                          const py::list& preds) {
  const Py_ssize_t n = PyList_GET_SIZE(durations.ptr());
  TAGPS_ENFORCE(PyList_GET_SIZE(resources.ptr()) == n && PyList_GET_SIZE(pred_counts.ptr()) == n,
                "durations, resources and pred_counts must have one item per task");
  sim::StepTasks s;
  s.duration.resize(n);
  s.resource_begin.resize(n + 1, 0);
  s.pred_begin.resize(n + 1, 0);
  for (Py_ssize_t t = 0; t < n; ++t) {
    s.duration[t] = PyFloat_AsDouble(PyList_GET_ITEM(durations.ptr(), t));
    if (s.duration[t] == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    PyObject* held = tuple_item(PyList_GET_ITEM(resources.ptr(), t), "resources");
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(held); ++k) {
      s.resources.push_back(as_int32(PyTuple_GET_ITEM(held, k), "resource"));
    }
    s.resource_begin[t + 1] = static_cast<int32_t>(s.resources.size());
    const int32_t count = as_int32(PyList_GET_ITEM(pred_counts.ptr(), t), "pred_count");
    TAGPS_ENFORCE_GE(count, 0, "pred_count of task ", t);
    s.pred_begin[t + 1] = s.pred_begin[t] + count;
  }
  const Py_ssize_t m = PyList_GET_SIZE(preds.ptr());
  TAGPS_ENFORCE_EQ(static_cast<Py_ssize_t>(s.pred_begin[n]), m, "preds must hold sum(pred_counts) items");
  s.preds.resize(m);
  for (Py_ssize_t k = 0; k < m; ++k) s.preds[k] = as_int32(PyList_GET_ITEM(preds.ptr(), k), "pred");
  return s;
}

std::vector<sim::StepWait> step_waits(const py::list& waits) {
  std::vector<sim::StepWait> out(PyList_GET_SIZE(waits.ptr()));
  for (size_t i = 0; i < out.size(); ++i) {
    PyObject* w = tuple_item(PyList_GET_ITEM(waits.ptr(), i), "waits");
    TAGPS_ENFORCE_EQ(PyTuple_GET_SIZE(w), 2, "a wait is (task, prereq)");
    out[i] = {as_int32(PyTuple_GET_ITEM(w, 0), "task"), as_int32(PyTuple_GET_ITEM(w, 1), "prereq")};
  }
  return out;
}

}  // namespace

void bind_sim(py::module_& m) {
  m.def(
      "list_schedule",
      [](const py::list& durations, const py::list& resources, const py::list& pred_counts,
         const py::list& preds, int steps, const py::list& waits, int num_resources) {
        sim::Timeline out = sim::list_schedule(step_tasks(durations, resources, pred_counts, preds), steps,
                                               step_waits(waits), num_resources);
        return py::make_tuple(std::move(out.start), std::move(out.finish), std::move(out.busy));
      },
      py::arg("durations"), py::arg("resources"), py::arg("pred_counts"), py::arg("preds"), py::arg("steps"),
      py::arg("waits"), py::arg("num_resources"), R"pbdoc(
List-schedule `steps` copies of one training step's tasks (tagps.strategy.simulator's inner loop).

Task t of the step lasts durations[t] seconds, holds the resources in the tuple resources[t] and waits for
the pred_counts[t] tasks that follow in the flat list preds (all created before it). Every (task, prereq)
in waits makes a later step's task also wait for the previous step's prereq. A task starts when its
predecessors are done and its resources are free; resources serve tasks in the order they become ready
(ties: creation order). Returns (start, finish, busy): per task of all steps (step k's task t at
k * len(durations) + t) and busy seconds per resource. ValueError on malformed input (a predecessor
that is not an earlier task, a resource or a wait out of range), TypeError on items of the wrong
type.)pbdoc");
}

}  // namespace tagps
