// C++ balancing core (pybind11). The algorithms are added with the balancer (issue 2).
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_isf_core, m) { m.doc() = "megatron-omnibal balancing core"; }
