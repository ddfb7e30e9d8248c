// Python names of the server engine (csrc/net), registered into tagps._core.
#include "bind_modules.h"

namespace tagps {

void bind_net_server(pybind11::module_& m) { (void)m; }

}  // namespace tagps
