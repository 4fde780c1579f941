// Results output for the command-line tools (kvdepotctl, kvdepot-bench):
// stdout carries only their results, whatever libraries print.
#ifndef KVDEPOT_CLIENT_CLI_OUTPUT_H_
#define KVDEPOT_CLIENT_CLI_OUTPUT_H_

#include <cstdio>

namespace kvdepot {

// Keeps the process's stdout for results and points fd 1 at stderr, so
// that what libraries print to stdout -- UCX logs there unless
// UCX_LOG_FILE says otherwise, and warns of any UCX_ variable it does not
// know -- never mixes with a block written to stdout or with JSON output.
// Call first thing in main, before any library prints. Afterwards
// std::cout and Results() write to the results (print with
// std::fprintf(Results(), ...), not printf); /dev/stdout is stderr. Where
// a descriptor cannot be had, everything stays on stdout as before. First
// opens /dev/null onto any of fds 0, 1 and 2 that is closed: a closed
// stderr's messages are dropped, never sent to stdout, and results
// written to a closed stdout still fail.
void SeparateResults();

// Where results go: the process's stdout as it was when SeparateResults
// ran (stdout before it does).
FILE* Results();

}  // namespace kvdepot

#endif  // KVDEPOT_CLIENT_CLI_OUTPUT_H_
