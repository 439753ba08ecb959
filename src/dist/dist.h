/* dist.h: the processes of one k3 job started by mpirun (Open MPI).
 *
 * A small API over MPI, so that nothing else includes mpi.h:
 *   k3_dist_init      from main, first. MPI starts only when mpirun launched
 *                     the process (OMPI_COMM_WORLD_SIZE or PMIX_RANK set): a
 *                     plain `k3 ...` pays no MPI start-up (a singleton
 *                     MPI_Init takes about a second) and is rank 0 of 1. Under
 *                     mpirun every rank then checks that all ranks run the same
 *                     binary with the same command line (refused otherwise).
 *   k3_dist_rank/size/host
 *   k3_dist_agree     every rank contributes a status; all get the same one
 *   k3_dist_allgather fixed-size records, in rank order
 *   k3_dist_exchange  each rank's block to every other rank, the sizes known
 *                     to all beforehand; the blocks land in rank order
 *   k3_dist_alltoall  the same with a block of its own for each peer
 *   k3_dist_bcast     rank 0's bytes to every rank (k3 chat's lines, k3
 *                     serve's commands to the ranks that follow rank 0)
 *   k3_dist_abort     one line naming this rank, then the whole job ends
 *   k3_dist_finish    from main, last: the job's exit code and its one line
 * A process that is not under mpirun (or a build without MPI) is a job of one
 * rank: every call is then a local no-op with the same results.
 *
 * Invariants:
 *   - every wait is bounded (K3_DIST_TIMEOUT seconds, default 600): a rank that
 *     has sent nothing in time is named on one line and the job is aborted,
 *     never a hang; a rank that dies is reported by mpirun, which ends the job;
 *   - results never depend on arrival order: blocks are handed over in rank
 *     order, so the arithmetic that follows is the same at every rank count;
 *   - one thread at a time calls these (MPI_THREAD_SERIALIZED): the main
 *     thread, or k3 serve's model worker while the main thread waits for a
 *     stop signal and calls none (the worker is joined before the main thread
 *     calls them again);
 *   - errors are deferred under mpirun: k3_dist_defer_error (called by the
 *     commands' error printer) records the line and k3_dist_finish prints one
 *     line for the job on rank 0 (naming the failing rank unless all ranks
 *     failed alike), so R ranks never print R copies of a usage error. */
#ifndef K3_DIST_DIST_H
#define K3_DIST_DIST_H

#include "util/common.h"

/* Starts MPI when under mpirun. Returns K3_OK or an exit code after having
 * printed one line (rank 0) when the ranks differ or MPI cannot start. */
int k3_dist_init(int *argc, char ***argv);
/* Ends the job: agrees on the exit code (the lowest failing rank's), prints the
 * deferred error line on rank 0, finalises MPI. Returns the code to exit with. */
int k3_dist_finish(int rc);

bool k3_dist_active(void);       /* under mpirun (even with one rank) */
int k3_dist_rank(void);
int k3_dist_size(void);
const char *k3_dist_host(int rank);  /* host name of a rank ("" before init) */
bool k3_dist_with_mpi(void);     /* this build links Open MPI */
/* MPI may be called from another thread than the main one (one at a time):
 * the library granted MPI_THREAD_SERIALIZED. True when not under mpirun. */
bool k3_dist_any_thread(void);

/* Records an error line to be printed by k3_dist_finish (under mpirun);
 * returns false when not under mpirun (the caller prints it itself). */
bool k3_dist_defer_error(int code, const char *msg);

/* Every rank passes its status (rc, *err); all return the status of the
 * lowest-ranked failing rank, with err->msg prefixed "rank R of N (HOST): "
 * unless every rank failed with the same line. what: names the step for the
 * timeout message. */
int k3_dist_agree(int rc, k3_err *err, const char *what);

/* all[r * n .. (r+1) * n) = rank r's `mine` (n bytes). */
void k3_dist_allgather(const void *mine, size_t n, void *all, const char *what);

/* Sends mine[0..mine_bytes) to every other rank and receives rank r's block
 * (their_bytes[r] bytes, known in advance) into theirs[r]; theirs[rank] and
 * their_bytes[rank] are ignored. what: names the step in a timeout message. */
void k3_dist_exchange(const void *mine, size_t mine_bytes, void *const *theirs, const size_t *their_bytes,
                      const char *what);

/* The schedule of k3_dist_exchange (Bruck's all-gather: ceil(log2 R)
 * rounds for any R, one message sent and one received a round, instead of
 * R - 1 of each). A rank keeps the blocks in relative order (position i:
 * rank (me + i) % R's block, position 0 its own). In round s (distance
 * d = 2^s) it sends positions [0, n) to rank *to = (me - d) mod R and
 * receives positions [*at = d, d + n) from rank *from = (me + d) mod R,
 * *n = min(d, R - d): after the rounds it holds every position. Blocks are
 * copied, never combined, so the bytes are the same as any other gather's.
 * Exposed for its tests. */
int k3_gather_rounds(int R);
void k3_gather_round(int R, int me, int s, int *to, int *from, int *at, int *n);

/* Like k3_dist_exchange, but a block of its own for each rank: to[r]
 * (to_bytes[r] bytes) goes to rank r; to[rank] and theirs[rank] are ignored.
 * Counts as an exchange for K3_DIST_FAULT. */
void k3_dist_alltoall(const void *const *to, const size_t *to_bytes, void *const *theirs, const size_t *their_bytes,
                      const char *what);

/* A line read by rank 0 from f (getline's contract: the length without a
 * terminator added, -1 at the end or on an error), handed to every rank, so
 * an interactive command (k3 chat) runs the same turns everywhere; the other
 * ranks do not read f. A wait without a bound: rank 0 waits for a person. */
long long k3_dist_getline(char **line, size_t *cap, FILE *f);

/* Rank 0's buf[0..n) to every other rank, which receives it into buf (n
 * known to all). bounded: the others wait at most K3_DIST_TIMEOUT seconds
 * (then rank 0 is named and the job ends); unbounded: the wait of a rank that
 * follows rank 0 for its next piece of work, which comes when a person or a
 * client asks. */
void k3_dist_bcast(void *buf, size_t n, bool bounded, const char *what);

/* Ranks after the first stop printing: their stdout and stderr go to
 * /dev/null (this module keeps its own copy of stderr for the job's error
 * lines). One process, or rank 0: nothing changes. */
void k3_dist_silence_others(void);

/* Prints "k3: rank R of N (HOST): <msg>" and ends every rank of the job with
 * err->code (MPI_Abort). Not under mpirun: prints "k3: <msg>" and exits. */
_Noreturn void k3_dist_abort(const k3_err *err);

/* What the collectives cost this process so far. */
typedef struct {
    uint64_t collectives;   /* agree, allgather and exchange calls */
    uint64_t bytes_sent;    /* payload bytes this rank sent (all peers) */
    double wait_s;          /* time inside the collectives (posting + waiting) */
    /* of which the gathers of the trunk's split products (tensor_par.h) */
    uint64_t split_gathers, split_bytes_sent;
    double split_wait_s;
    /* weight bytes those products read on this rank, and what one process
     * reads for the same products (every rank's share together) */
    uint64_t split_read, split_whole;
} k3_dist_stats;
k3_dist_stats k3_dist_get_stats(void);
/* Adds a split product's figures (the split_* fields of d) to the stats. */
void k3_dist_note_split(const k3_dist_stats *d);

/* Test hook: K3_DIST_FAULT="KIND:RANK[:N]" makes rank RANK fail at its N-th
 * exchange (default 1): KIND "die" kills the process with SIGKILL (a crash:
 * no word from it), "hang" stops answering (it sleeps until killed), "error"
 * makes the exchange's caller fail with a runtime error (k3_dist_fault_error
 * returns true once, at that exchange). Read at init. */
bool k3_dist_fault_error(void);

#endif
