#include "client/cli_output.h"

#include <unistd.h>

#include <ext/stdio_sync_filebuf.h>
#include <iostream>

namespace kvdepot {
namespace {

FILE* g_results = nullptr;

}  // namespace

FILE* Results() { return g_results != nullptr ? g_results : stdout; }

void SeparateResults() {
  if (g_results != nullptr) return;
  std::cout.flush();
  std::fflush(stdout);
  const int fd = dup(STDOUT_FILENO);
  if (fd < 0) return;
  FILE* results = fdopen(fd, "w");
  if (results == nullptr) {
    close(fd);
    return;
  }
  if (dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
    std::fclose(results);
    return;
  }
  g_results = results;
  static __gnu_cxx::stdio_sync_filebuf<char> buffer(results);
  std::cout.rdbuf(&buffer);
}

}  // namespace kvdepot
