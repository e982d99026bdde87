/*
 * resolver-load: getaddrinfo() of one name at a fixed rate, through the C library's resolver
 * (which reads /etc/resolv.conf on every call), for the benchmark's musl client:
 *
 *   musl-gcc -static -O2 -pthread -o resolver-load testdata/resolver-load.c
 *   resolver-load RATE DURATION_MS NAME OUT [unspec]
 *
 * Each lookup runs in its own thread, started on schedule whatever the others are doing (a
 * pod's application threads). OUT gets one line per lookup, as `dnsload --lookups-out` writes
 * them: start (ms since the run's start), latency (ms), who answered (1.1.1.1: cache, 2.2.2.2:
 * coredns, else other) or "failed", and 0 (attempts are not visible). stdout gets one line
 * `SUMMARY {"start_unix_ms":…,"sent":…,"failed":…,"unfinished":…}` once every lookup ended,
 * or after 40 s. With `unspec`, each lookup asks for both families (AF_UNSPEC: an A and an
 * AAAA query) and its first IPv4 address, else its first address, says who answered
 * (fd00::1:1:1:1: cache, fd00::2:2:2:2: coredns).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char *name;
static FILE *out;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static struct timespec start;
static atomic_long in_flight, failed;
static int family = AF_INET;

static double ms_since(const struct timespec *from) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - from->tv_sec) * 1e3 + (now.tv_nsec - from->tv_nsec) / 1e6;
}

static void *lookup(void *arg) {
    (void)arg;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double started = ms_since(&start);
    struct addrinfo hints = {.ai_family = family, .ai_socktype = SOCK_DGRAM}, *list = NULL;
    int rc = getaddrinfo(name, NULL, &hints, &list);
    double latency = ms_since(&t0);
    const char *origin = "failed";
    if (rc == 0 && list != NULL) {
        const struct addrinfo *pick = list;
        for (const struct addrinfo *a = list; a != NULL; a = a->ai_next) {
            if (a->ai_family == AF_INET) { pick = a; break; }
        }
        char ip[INET6_ADDRSTRLEN] = "";
        if (pick->ai_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)pick->ai_addr)->sin_addr, ip, sizeof ip);
        else
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)pick->ai_addr)->sin6_addr, ip, sizeof ip);
        int cache = strcmp(ip, "1.1.1.1") == 0 || strcmp(ip, "fd00::1:1:1:1") == 0;
        int coredns = strcmp(ip, "2.2.2.2") == 0 || strcmp(ip, "fd00::2:2:2:2") == 0;
        origin = cache ? "cache" : coredns ? "coredns" : "other";
    } else {
        atomic_fetch_add(&failed, 1);
    }
    if (list != NULL) freeaddrinfo(list);
    pthread_mutex_lock(&out_lock);
    fprintf(out, "%.3f %.3f %s 0\n", started, latency, origin);
    pthread_mutex_unlock(&out_lock);
    atomic_fetch_sub(&in_flight, 1);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5 && !(argc == 6 && strcmp(argv[5], "unspec") == 0)) {
        fprintf(stderr, "usage: resolver-load RATE DURATION_MS NAME OUT [unspec]\n");
        return 2;
    }
    if (argc == 6) family = AF_UNSPEC;
    long rate = atol(argv[1]), duration_ms = atol(argv[2]);
    name = argv[3];
    if (rate < 1 || rate > 100000 || duration_ms < 1 || (out = fopen(argv[4], "w")) == NULL) {
        fprintf(stderr, "resolver-load: bad rate, duration or output file\n");
        return 2;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);

    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    clock_gettime(CLOCK_MONOTONIC, &start);
    long planned = rate * duration_ms / 1000, sent = 0;
    for (long i = 0; i < planned; i++) {
        long long at_ns = (long long)start.tv_sec * 1000000000LL + start.tv_nsec + i * 1000000000LL / rate;
        struct timespec at = {.tv_sec = at_ns / 1000000000LL, .tv_nsec = at_ns % 1000000000LL};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL);
        pthread_t thread;
        atomic_fetch_add(&in_flight, 1);
        if (pthread_create(&thread, &attr, lookup, NULL) != 0) {
            atomic_fetch_sub(&in_flight, 1);
            atomic_fetch_add(&failed, 1);
            continue;
        }
        sent++;
    }
    /* Every lookup ends within the resolver's timeouts; 40 s is the safety net. */
    for (int i = 0; i < 4000 && atomic_load(&in_flight) > 0; i++) {
        struct timespec tick = {.tv_sec = 0, .tv_nsec = 10000000};
        nanosleep(&tick, NULL);
    }
    pthread_mutex_lock(&out_lock);
    fflush(out);
    long unfinished = atomic_load(&in_flight);
    printf("SUMMARY {\"start_unix_ms\":%lld,\"sent\":%ld,\"failed\":%ld,\"unfinished\":%ld}\n",
           (long long)wall.tv_sec * 1000 + wall.tv_nsec / 1000000, sent, atomic_load(&failed),
           unfinished);
    fflush(stdout);
    _exit(0);
}
