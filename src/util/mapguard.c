/* mapguard.c: see mapguard.h. */
#include "util/mapguard.h"
#include "util/common.h"

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 1024
#define PATH_MAX_GUARD 512

static struct {
    volatile uintptr_t start, len;
    char path[PATH_MAX_GUARD];
} slots[SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static bool installed;

static void put(const char *s) {
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(2, s, n);
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
    (void)sig;
    (void)ctx;
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < SLOTS; i++) {
        uintptr_t s = slots[i].start, l = slots[i].len;
        if (l && a >= s && a - s < l) {
            put("k3: ");
            put(slots[i].path);
            put(": the file shrank while it was mapped (truncated by another process?)\n");
            _exit(K3_EXIT_DATA);
        }
    }
    put("k3: bus error reading a mapped file (truncated by another process?)\n");
    _exit(K3_EXIT_DATA);
}

void k3_mapguard_add(const void *addr, size_t len, const char *path) {
    if (!addr || !len) return;
    pthread_mutex_lock(&lock);
    if (!installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGBUS, &sa, NULL);
        installed = true;
    }
    for (int i = 0; i < SLOTS; i++)
        if (!slots[i].len) {
            size_t n = strlen(path);
            if (n >= PATH_MAX_GUARD) path += n - (PATH_MAX_GUARD - 1); /* keep the file name end */
            snprintf(slots[i].path, sizeof slots[i].path, "%s", path);
            slots[i].start = (uintptr_t)addr;
            __atomic_store_n(&slots[i].len, (uintptr_t)len, __ATOMIC_RELEASE);
            break;
        }
    pthread_mutex_unlock(&lock);
}

void k3_mapguard_remove(const void *addr) {
    if (!addr) return;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].len && slots[i].start == (uintptr_t)addr) {
            __atomic_store_n(&slots[i].len, (uintptr_t)0, __ATOMIC_RELEASE);
            break;
        }
    pthread_mutex_unlock(&lock);
}
