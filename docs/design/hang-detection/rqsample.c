// Research prototype for docs/design/hang-detection.md: read one listening socket's receive queue with an
// exact-match sock_diag request (INET_DIAG_REQ_V2 without NLM_F_DUMP: udp_dump_one /
// inet_diag_dump_one_icsk), or with a dump, and trace it.
//
// rqsample once  udp|tcp IP PORT [swap]      one exact request, print the answer
// rqsample bench udp|tcp IP PORT N exact|dump   N requests back to back, print us/request (user, sys)
// rqsample trace udp IP PORT INTERVAL_US SECONDS   print "ms_epoch rqueue drops" per sample
// rqsample loop  udp IP PORT INTERVAL_US SECONDS   sample, print only CPU used (getrusage)
// rqsample sleep udp IP PORT INTERVAL_US SECONDS   the same wakeups without the request
#include <arpa/inet.h>
#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int fd;
static struct { struct nlmsghdr nlh; struct inet_diag_req_v2 r; } req;
static char buf[65536];

static double now_ms(void) {
  struct timespec t; clock_gettime(CLOCK_REALTIME, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void build(int proto, const char *ip, int port, int dump, int swap) {
  memset(&req, 0, sizeof req);
  req.nlh.nlmsg_len = sizeof req;
  req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.nlh.nlmsg_flags = NLM_F_REQUEST | (dump ? NLM_F_DUMP : 0);
  req.r.sdiag_family = AF_INET;
  req.r.sdiag_protocol = proto;
  req.r.idiag_ext = 1 << (INET_DIAG_SKMEMINFO - 1);
  req.r.idiag_states = proto == IPPROTO_TCP ? (1 << 10) /*LISTEN*/ : (1 << 7) /*CLOSE*/;
  uint32_t a; inet_pton(AF_INET, ip, &a);
  if (!dump) {
    // UDP: udp_dump_one looks up (saddr=id.src, daddr=id.dst): the local side is "dst".
    // TCP: inet_diag_find_one_icsk looks up (saddr=id.dst, daddr=id.src): the local side is "src".
    int local_is_dst = (proto == IPPROTO_UDP) ^ swap;
    if (local_is_dst) { req.r.id.idiag_dst[0] = a; req.r.id.idiag_dport = htons(port); }
    else { req.r.id.idiag_src[0] = a; req.r.id.idiag_sport = htons(port); }
    // RQ_COOKIE=<u64>: match this socket only (sock_diag_check_cookie: ESTALE if it is another).
    const char *c = getenv("RQ_COOKIE");
    unsigned long long ck = c ? strtoull(c, NULL, 10) : 0;
    req.r.id.idiag_cookie[0] = c ? (uint32_t)ck : INET_DIAG_NOCOOKIE;
    req.r.id.idiag_cookie[1] = c ? (uint32_t)(ck >> 32) : INET_DIAG_NOCOOKIE;
  }
}

struct result { int found; uint32_t rq, wq; uint32_t drops; uint64_t cookie; char local[64]; int err; };

static void parse_msg(struct nlmsghdr *h, struct result *res, uint32_t want, int port) {
  struct inet_diag_msg *m = NLMSG_DATA(h);
  if (want && (m->id.idiag_src[0] != want || ntohs(m->id.idiag_sport) != port)) return;
  res->found++;
  res->rq = m->idiag_rqueue; res->wq = m->idiag_wqueue;
  res->cookie = m->id.idiag_cookie[0] | (uint64_t)m->id.idiag_cookie[1] << 32;
  char a[32]; inet_ntop(AF_INET, m->id.idiag_src, a, sizeof a);
  snprintf(res->local, sizeof res->local, "%s:%d", a, ntohs(m->id.idiag_sport));
  int len = h->nlmsg_len - NLMSG_LENGTH(sizeof *m);
  struct rtattr *at = (struct rtattr *)(m + 1);
  for (; RTA_OK(at, len); at = RTA_NEXT(at, len))
    if (at->rta_type == INET_DIAG_SKMEMINFO) res->drops = ((uint32_t *)RTA_DATA(at))[SK_MEMINFO_DROPS];
}

static int query(struct result *res, int dump, uint32_t want, int port) {
  memset(res, 0, sizeof *res);
  if (send(fd, &req, sizeof req, 0) < 0) { perror("send"); exit(1); }
  for (;;) {
    int n = recv(fd, buf, sizeof buf, 0);
    if (n < 0) { perror("recv"); exit(1); }
    for (struct nlmsghdr *h = (void *)buf; NLMSG_OK(h, n); h = NLMSG_NEXT(h, n)) {
      if (h->nlmsg_type == NLMSG_DONE) return 0;
      if (h->nlmsg_type == NLMSG_ERROR) { res->err = ((struct nlmsgerr *)NLMSG_DATA(h))->error; return 0; }
      if (h->nlmsg_type == SOCK_DIAG_BY_FAMILY) parse_msg(h, res, dump ? want : 0, port);
    }
    if (!dump) return 0;
  }
}

static double tv(struct timeval t) { return t.tv_sec * 1e6 + t.tv_usec; }

// On-CPU time of this thread in us, exact (the scheduler's sum_exec_runtime), where getrusage's
// user/sys split is tick-sampled on this kernel.
static double oncpu_us(void) {
  FILE *f = fopen("/proc/thread-self/schedstat", "r"); unsigned long long ns = 0;
  if (f) { if (fscanf(f, "%llu", &ns) != 1) ns = 0; fclose(f); }
  return ns / 1e3;
}

int main(int argc, char **argv) {
  if (argc < 5) { fprintf(stderr, "usage: see source\n"); return 2; }
  const char *mode = argv[1];
  int proto = !strcmp(argv[2], "tcp") ? IPPROTO_TCP : IPPROTO_UDP;
  const char *ip = argv[3]; int port = atoi(argv[4]);
  uint32_t want; inet_pton(AF_INET, ip, &want);
  fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) { perror("socket"); return 1; }
  struct result res;
  if (!strcmp(mode, "once")) {
    int swap = argc > 5 && !strcmp(argv[5], "swap");
    build(proto, ip, port, 0, swap);
    query(&res, 0, 0, 0);
    printf("err=%d found=%d local=%s rqueue=%u wqueue=%u drops=%u cookie=%llu\n", res.err, res.found,
           res.local, res.rq, res.wq, res.drops, (unsigned long long)res.cookie);
    return 0;
  }
  if (!strcmp(mode, "bench")) {
    long n = atol(argv[5]); int dump = !strcmp(argv[6], "dump");
    build(proto, ip, port, dump, 0);
    struct rusage a, b; getrusage(RUSAGE_SELF, &a); double t0 = now_ms(), c0 = oncpu_us();
    for (long i = 0; i < n; i++) query(&res, dump, want, port);
    getrusage(RUSAGE_SELF, &b); double t1 = now_ms();
    printf("%s %s n=%ld found=%d oncpu=%.2fus wall=%.2fus user=%.2fus sys=%.2fus per request\n", argv[2], argv[6], n, res.found, (oncpu_us() - c0) / n,
           (t1 - t0) * 1e3 / n, (tv(b.ru_utime) - tv(a.ru_utime)) / n, (tv(b.ru_stime) - tv(a.ru_stime)) / n);
    return 0;
  }
  long iv = atol(argv[5]); double secs = atof(argv[6]);
  int trace = !strcmp(mode, "trace");
  build(proto, ip, port, 0, 0);
  struct timespec next; clock_gettime(CLOCK_MONOTONIC, &next);
  long samples = (long)(secs * 1e6 / iv);
  struct rusage a, b; getrusage(RUSAGE_SELF, &a); double c0 = oncpu_us();
  setvbuf(stdout, NULL, _IOFBF, 1 << 20);
  for (long i = 0; i < samples; i++) {
    next.tv_nsec += iv * 1000;
    while (next.tv_nsec >= 1000000000) { next.tv_nsec -= 1000000000; next.tv_sec++; }
    clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    if (strcmp(mode, "sleep")) query(&res, 0, 0, 0);  // "sleep": the timer wakeups alone
    if (trace) printf("%.3f %u %u %d\n", now_ms(), res.rq, res.drops, res.found);
  }
  getrusage(RUSAGE_SELF, &b);
  double cpu = oncpu_us() - c0;
  fprintf(trace ? stderr : stdout, "interval=%ldus samples=%ld cpu=%.0fus => %.3f mCPU (user %.0f sys %.0f us)\n", iv, samples, cpu,
          cpu / (secs * 1e6) * 1e3, tv(b.ru_utime) - tv(a.ru_utime), tv(b.ru_stime) - tv(a.ru_stime));
  return 0;
}
