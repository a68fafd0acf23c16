// The precompiled header of the test programs (tests/meson.build, `test_objects`): the two headers
// every test file includes, parsed once per build instead of once per file (about 4.7 s of GCC's
// time each, json.hpp alone 2.8 s). Each test file still includes what it uses, so the programs
// compile the same with -Db_pch=false.
#include <doctest/doctest.h>
#include <linum/linum.hpp>
