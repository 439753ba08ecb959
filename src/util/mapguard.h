/* mapguard.h: a mapped file that another process truncates raises SIGBUS on
 * the next access to a page past its new end. Without a handler the process
 * dies with no message; with this one it prints one line naming the file and
 * exits K3_EXIT_DATA (4).
 *
 * Invariants: the handler only reads a fixed table of (start, length, path)
 * slots and calls write(2) and _exit(2), which are async-signal-safe; slots
 * are filled and cleared under a lock outside the handler, and a path is
 * copied into its slot, so it outlives the caller's string. A SIGBUS at an
 * address in no registered mapping still exits 4 with a generic line. */
#ifndef K3_UTIL_MAPGUARD_H
#define K3_UTIL_MAPGUARD_H

#include <stddef.h>

/* Registers [addr, addr+len) as a mapping of path (installs the handler on
 * first use). Silently does nothing when the table is full. */
void k3_mapguard_add(const void *addr, size_t len, const char *path);
/* Forgets the mapping that starts at addr (call before munmap). */
void k3_mapguard_remove(const void *addr);

#endif
