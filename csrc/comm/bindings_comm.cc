// Python names of the intra-machine reduction arena (csrc/comm), registered into tagps._core.
#include "bind_modules.h"

namespace tagps {

void bind_comm(pybind11::module_& m) { (void)m; }

}  // namespace tagps
