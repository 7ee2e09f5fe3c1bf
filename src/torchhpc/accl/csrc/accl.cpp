// The backend's one translation unit: torch's headers, which cost most of a build, are parsed once.  Each file
// below holds one part (docs/development.md lists them); corebuild compiles only this one.
#include "accl.hpp"

#include "wire.cpp"
#include "reduction.cpp"
#include "ProcessGroupACCL.cpp"
#include "exchange.cpp"
#include "collectives.cpp"
#include "ring.cpp"
#include "p2p.cpp"
#include "flight.cpp"
#include "module.cpp"
