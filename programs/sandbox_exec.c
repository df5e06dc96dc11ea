/* The sandbox's helper, run by bubblewrap inside the sandbox (composer2.env_base). Two modes.

   exec:  sandbox_exec UID USERNS CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE -- PROGRAM ARGS...
     what `setpriv` + `unshare --user` + `prlimit` did in three execs, in one (a bwrap per command):
     UID >= 0: drop supplementary groups, become UID:UID, clear every capability, set no_new_privs;
     USERNS 1: then enter a new user namespace mapping UID to itself (RLIMIT_NPROC then counts per sandbox);
     then set the limits (CPU soft CPU_S, hard CPU_S + 2; core 0) and exec PROGRAM. Exit 127 on any failure.

   serve: sandbox_exec --serve FD
     one long-lived bwrap per sandbox, this as its PID 1 (bwrap --as-pid-1), commands over the unix socket FD:
       host -> 'C' (carrying stdout's and stderr's write ends as SCM_RIGHTS), u32 length, then NUL-terminated fields
               UID USERNS CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE TMP_BYTES SHM_BYTES CWD NENV ENV... PROGRAM ARGS...
       host -> 'K': kill the running command (ignored between commands);
       self -> 'R' once ready, then 'E' + i32 per command: its exit code, or 128 + the signal that ended it.
     Each command runs in a fresh mount namespace with its own empty /tmp and /dev/shm (tmpfs), in a new session,
     stdin /dev/null, with every capability dropped and the limits above (the exec mode's steps). When it exits, or
     on 'K', every other process of the sandbox is killed (kill(-1) from PID 1), so nothing outlives its command.
     EOF on FD (the host closed it or died) ends the sandbox. Exit 127 on a broken protocol. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
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

static void drop_caps(void) {
  struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct d[2];
  memset(d, 0, sizeof d);
  if (syscall(SYS_capset, &h, d) != 0) die("capset");
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

/* f: UID USERNS CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE; then exec prog with argv (and envp, or the current one) */
static void confine_and_exec(char **f, int always_drop, char **argv, char **envp) {
  long uid = strtol(f[0], NULL, 10);
  int userns = atoi(f[1]);
  unsigned long long cpu = strtoull(f[2], NULL, 10);
  if (uid >= 0) {
    if (setgroups(0, NULL) != 0) die("setgroups");
    if (setresgid(uid, uid, uid) != 0) die("setresgid");
    if (setresuid(uid, uid, uid) != 0) die("setresuid");
  }
  if (uid >= 0 || always_drop) {
    drop_caps();
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
  lim(RLIMIT_AS, strtoull(f[3], NULL, 10), strtoull(f[3], NULL, 10));
  lim(RLIMIT_NPROC, strtoull(f[4], NULL, 10), strtoull(f[4], NULL, 10));
  lim(RLIMIT_FSIZE, strtoull(f[5], NULL, 10), strtoull(f[5], NULL, 10));
  lim(RLIMIT_NOFILE, strtoull(f[6], NULL, 10), strtoull(f[6], NULL, 10));
  lim(RLIMIT_CORE, 0, 0);
  if (envp) execve(argv[0], argv, envp); else execv(argv[0], argv);
  die(argv[0]);
}

static int read_full(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r; n -= (size_t)r;
  }
  return 0;
}

static void reply(int sock, int code) {
  char msg[5] = {'E'};
  int32_t c = code;
  memcpy(msg + 1, &c, 4);
  if (write(sock, msg, 5) != 5) _exit(0);   /* the host is gone */
}

static void kill_all(void) {   /* as PID 1: every other process of the sandbox; then reap them */
  kill(-1, SIGKILL);
  while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {}
}

static void tmpfs(const char *where, const char *bytes) {
  char opts[64];
  snprintf(opts, sizeof opts, "mode=1777,size=%s", bytes);
  if (mount("tmpfs", where, "tmpfs", MS_NOSUID | MS_NODEV, opts) != 0) die(where);
}

/* the command's own process: fresh mounts for /tmp and /dev/shm, its pipes, its session, then confined */
static void child(char **f, int nf, int out, int err) {
  sigset_t none; sigemptyset(&none); sigprocmask(SIG_SETMASK, &none, NULL);
  int nenv = atoi(f[10]);
  if (11 + nenv >= nf) { fprintf(stderr, "sandbox_exec: bad request\n"); _exit(127); }
  char **envp = calloc(nenv + 1, sizeof *envp), **argv = calloc(nf - 11 - nenv + 1, sizeof *argv);
  for (int i = 0; i < nenv; i++) envp[i] = f[11 + i];
  for (int i = 11 + nenv; i < nf; i++) argv[i - 11 - nenv] = f[i];
  if (unshare(CLONE_NEWNS) != 0) die("unshare(CLONE_NEWNS)");
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) die("make / private");
  tmpfs("/tmp", f[7]); tmpfs("/dev/shm", f[8]);
  int in = open("/dev/null", O_RDONLY);
  if (in < 0 || dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) die("stdio");
  if (in > 2) close(in);
  if (out > 2) close(out);
  if (err > 2 && err != out) close(err);
  setsid();
  if (chdir(f[9]) != 0) die(f[9]);
  confine_and_exec(f, 1, argv, envp);
}

static int serve(int sock) {
  sigset_t chld; sigemptyset(&chld); sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, NULL);
  int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) die("signalfd");
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);   /* bubblewrap killed from outside: so is the sandbox */
  prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  fcntl(sock, F_SETFD, FD_CLOEXEC);
  if (write(sock, "R", 1) != 1) return 0;
  for (;;) {
    char tag; int fds[2] = {-1, -1};
    char cbuf[CMSG_SPACE(sizeof fds)];
    struct iovec iov = {&tag, 1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t r = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return 0;   /* the host closed the socket: the sandbox ends */
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS && cm->cmsg_len == CMSG_LEN(sizeof fds))
      memcpy(fds, CMSG_DATA(cm), sizeof fds);
    if (tag == 'K') { for (int i = 0; i < 2; i++) if (fds[i] >= 0) close(fds[i]); continue; }   /* late: nothing runs */
    uint32_t len;
    if (tag != 'C' || fds[0] < 0 || fds[1] < 0 || read_full(sock, &len, 4) || len > (64u << 20)) {
      fprintf(stderr, "sandbox_exec: bad request from the host\n"); return 127;
    }
    char *buf = malloc(len + 1);
    if (!buf || read_full(sock, buf, len)) { fprintf(stderr, "sandbox_exec: short request\n"); return 127; }
    buf[len] = 0;
    int nf = 0;
    for (uint32_t i = 0; i < len; i++) nf += buf[i] == 0;
    char **f = calloc(nf + 1, sizeof *f);
    for (uint32_t i = 0, k = 0, s = 0; i < len; i++) if (buf[i] == 0) { f[k++] = buf + s; s = i + 1; }
    if (nf < 12) { fprintf(stderr, "sandbox_exec: request has %d fields\n", nf); return 127; }
    pid_t pid = fork();
    if (pid == 0) { close(sock); close(sfd); child(f, nf, fds[0], fds[1]); }
    close(fds[0]); close(fds[1]); free(f); free(buf);
    int code = 127, done = pid < 0;
    if (pid < 0) fprintf(stderr, "sandbox_exec: fork: %s\n", strerror(errno));
    while (!done) {
      struct pollfd p[2] = {{sock, POLLIN, 0}, {sfd, POLLIN, 0}};
      if (poll(p, 2, -1) < 0) { if (errno == EINTR) continue; die("poll"); }
      if (p[1].revents) {
        struct signalfd_siginfo si;
        while (read(sfd, &si, sizeof si) == sizeof si) {}
        int st; pid_t w;
        while ((w = waitpid(-1, &st, WNOHANG)) > 0)
          if (w == pid) { code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); done = 1; }
      }
      if (!done && p[0].revents) {
        char k;
        ssize_t n = read(sock, &k, 1);
        if (n <= 0) { kill_all(); return 0; }
        if (k == 'K') kill(-1, SIGKILL);
      }
    }
    kill_all();
    reply(sock, code);
  }
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--serve") == 0) return serve(atoi(argv[2]));
  if (argc < 10 || strcmp(argv[8], "--") != 0) { fprintf(stderr, "sandbox_exec: bad arguments\n"); return 127; }
  confine_and_exec(argv + 1, 0, argv + 9, NULL);
  return 127;
}
