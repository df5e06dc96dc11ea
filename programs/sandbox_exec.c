/* The last link of the sandbox chain, run by bubblewrap inside the sandbox (composer2.env_base._chain):
   what `setpriv` + `unshare --user` + `prlimit` did in three execs, in one.
   usage: sandbox_exec UID USERNS CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE -- PROGRAM ARGS...
     UID >= 0: drop supplementary groups, become UID:UID, clear every capability, set no_new_privs;
     USERNS 1: then enter a new user namespace mapping UID to itself (RLIMIT_NPROC then counts per sandbox);
     then set the limits (CPU soft CPU_S, hard CPU_S + 2; core 0) and exec PROGRAM. Exit 127 on any failure. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static void die(const char *what) { fprintf(stderr, "sandbox_exec: %s: %s\n", what, strerror(errno)); _exit(127); }

static void put(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) die(path);
  if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) die(path);
  close(fd);
}

static void lim(int res, unsigned long long soft, unsigned long long hard) {
  struct rlimit r = {soft, hard};
  if (setrlimit(res, &r) != 0) die("setrlimit");
}

int main(int argc, char **argv) {
  if (argc < 10 || strcmp(argv[8], "--") != 0) { fprintf(stderr, "sandbox_exec: bad arguments\n"); return 127; }
  long uid = strtol(argv[1], NULL, 10);
  int userns = atoi(argv[2]);
  unsigned long long cpu = strtoull(argv[3], NULL, 10);
  if (uid >= 0) {
    if (setgroups(0, NULL) != 0) die("setgroups");
    if (setresgid(uid, uid, uid) != 0) die("setresgid");
    if (setresuid(uid, uid, uid) != 0) die("setresuid");
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    memset(d, 0, sizeof d);
    if (syscall(SYS_capset, &h, d) != 0) die("capset");
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);   /* the uid change made /proc/self root's; the exec below resets this anyway */
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("no_new_privs");
  if (userns) {
    char map[64];
    if (unshare(CLONE_NEWUSER) != 0) die("unshare(CLONE_NEWUSER)");
    put("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "%ld %ld 1", uid, uid); put("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "%ld %ld 1", uid, uid); put("/proc/self/gid_map", map);
  }
  lim(RLIMIT_CPU, cpu, cpu + 2);
  lim(RLIMIT_AS, strtoull(argv[4], NULL, 10), strtoull(argv[4], NULL, 10));
  lim(RLIMIT_NPROC, strtoull(argv[5], NULL, 10), strtoull(argv[5], NULL, 10));
  lim(RLIMIT_FSIZE, strtoull(argv[6], NULL, 10), strtoull(argv[6], NULL, 10));
  lim(RLIMIT_NOFILE, strtoull(argv[7], NULL, 10), strtoull(argv[7], NULL, 10));
  lim(RLIMIT_CORE, 0, 0);
  execv(argv[9], argv + 9);
  die(argv[9]);
  return 127;
}
