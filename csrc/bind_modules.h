// Each subsystem of tagps._core registers its own Python names; bindings.cc calls these in turn.
#pragma once

#include <pybind11/pybind11.h>

namespace tagps {

#ifdef TAGPS_HAVE_NET
// csrc/net: the PS communication engine (server data loop, worker push/pull) over libzmq.
void bind_net(pybind11::module_& m);
#endif

}  // namespace tagps
