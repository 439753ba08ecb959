/* identity.h: the 64-bit identity of a checkpoint directory.
 *
 * A saved session (session.h) and the ranks of an mpirun job (each opens its
 * own copy) must know that two opens are the same checkpoint. The identity
 * hashes the files' bytes themselves, not what was parsed from them:
 * config.json, then every shard of the open index in name order (its name,
 * its 8-byte header length and JSON header, i.e. its tensor table, and the
 * first and last 4 KiB of its data: two models of one architecture have the
 * same tables), then the tokenizer files (tiktoken.model,
 * tokenizer_config.json; absent ones count as "-"), then the caller's salt
 * (what changes a state's bits or size: the effective layer count, the MLA
 * epsilon choice) first of all.
 *
 * Invariant: the value is the same for the same bytes on every host and
 * every build (session files written by one build load in the next). */
#ifndef K3_FORMATS_IDENTITY_H
#define K3_FORMATS_IDENTITY_H

#include "formats/safetensors.h"

/* From an index already open on model_dir (the engine's): no shard is listed
 * or parsed again. tok_dir NULL: model_dir. Errors: K3_EXIT_RUNTIME /
 * K3_EXIT_DATA for unreadable files. */
int k3_model_identity_of(const char *model_dir, st_index *ix, const char *tok_dir, uint64_t salt, uint64_t *out,
                           k3_err *err);

/* The same, opening (and closing) the index of model_dir itself
 * (st_open's errors besides). */
int k3_model_identity(const char *model_dir, const char *tok_dir, uint64_t salt, uint64_t *out, k3_err *err);

#endif
