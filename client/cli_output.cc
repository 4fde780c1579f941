#include "client/cli_output.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <ext/stdio_sync_filebuf.h>
#include <iostream>

namespace kvdepot {
namespace {

FILE* g_results = nullptr;

// Opens /dev/null onto each of fds 0, 1 and 2 that is closed, so that no
// descriptor made later takes its number: with fd 2 closed, the dup of
// stdout for the results was fd 2, and every error message went to stdout.
// A closed stderr's messages are then dropped. A closed stdout gets
// /dev/null read-only: results written to it still fail (EBADF), so the
// tools report that they could not write them, as before.
void OpenStandardDescriptors() {
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    // The lowest free number: `fd`, the ones below it being open.
    const int null_fd =
        open("/dev/null", fd == STDERR_FILENO ? O_WRONLY : O_RDONLY);
    if (null_fd >= 0 && null_fd != fd) {
      dup2(null_fd, fd);
      close(null_fd);
    }
  }
}

}  // namespace

FILE* Results() { return g_results != nullptr ? g_results : stdout; }

void SeparateResults() {
  if (g_results != nullptr) return;
  OpenStandardDescriptors();
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
