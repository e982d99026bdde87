/*
 * pause: the pod sandbox's process, and the idle entrypoint of the test bed's client image (the
 * tests run their load with `kubectl exec`). Sleeps until SIGTERM or SIGINT, then exits 0; as a
 * pod's init process it also reaps orphans. Built static (musl-gcc), so the image needs nothing
 * else:  musl-gcc -static -Os -o pause pause.c
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, 0, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = quit}, child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGTERM, &stop, 0);
    sigaction(SIGINT, &stop, 0);
    sigaction(SIGCHLD, &child, 0);
    for (;;) pause();
}
