/* The floor for the launch benchmark: posix_spawn N copies of a program back to back, then reap
 * them all. Measured by the same harness as the launchers, so "ddprun minus floor" is ddprun's
 * own cost (store, environment, pidfds, parsing, dynamic loading). */
#define _GNU_SOURCE
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

extern char** environ;

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: spawn_floor N PROGRAM\n");
    return 2;
  }
  const int n = atoi(argv[1]);
  char* args[] = {argv[2], NULL};
  pid_t* pids = calloc((size_t)n, sizeof(pid_t));
  if (!pids) return 1;
  for (int i = 0; i < n; ++i) {
    if (posix_spawn(&pids[i], argv[2], NULL, NULL, args, environ) != 0) {
      perror("posix_spawn");
      return 1;
    }
  }
  int failed = 0;
  for (int i = 0; i < n; ++i) {
    int status = 0;
    if (waitpid(pids[i], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  free(pids);
  return failed;
}
