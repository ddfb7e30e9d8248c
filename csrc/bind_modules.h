// Each subsystem of tagps._core registers its own Python names; bindings.cc calls these in turn.
#pragma once

#include <pybind11/pybind11.h>

namespace tagps {

// csrc/comm: the intra-machine reduction arena (shared memory summed with the kernels).
void bind_comm(pybind11::module_& m);

// csrc/sim: the simulator's list scheduler (tagps.strategy.simulator).
void bind_sim(pybind11::module_& m);

#ifdef TAGPS_HAVE_NET
// csrc/net: the PS communication engine over libzmq: the server's data loop and the worker's push/pull.
void bind_net_server(pybind11::module_& m);
void bind_net_client(pybind11::module_& m);
#endif

}  // namespace tagps
