/*
 * shardmuon: the Muon optimizer's Newton-Schulz orthogonalization for matrices that are
 * sharded across the ranks of a group, numerically equal to the same computation on the
 * gathered matrix.
 *
 * Conventions of this C API:
 *  - Every function returns a shardmuon_status. SHARDMUON_SUCCESS is 0; on any other value
 *    shardmuon_last_error() returns a message (per thread) that names the offending argument
 *    and its value. C++ exceptions never cross this boundary.
 *  - GPU work is enqueued on the CUDA stream the caller passes (as a void*, a cudaStream_t;
 *    NULL is the legacy default stream), never on another, and the Newton-Schulz and step
 *    calls do not wait for it, except for the cross-rank argument check (see
 *    shardmuon_newton_schulz), which waits for a few bytes exchanged on a private channel,
 *    never for the caller's stream. The calls that do wait say so: a step under the RAISE
 *    policy, save and load, shardmuon_context_nonfinite_counts, and creating or destroying a
 *    buffer or a context.
 *  - Matrices are row-major (PyTorch's out x in layout) and contiguous.
 *  - Calls that take a communicator are collective: every rank of the group makes them, in
 *    the same order. If the ranks pass arguments that disagree, every rank returns an error
 *    instead of entering mismatched collectives.
 */
#ifndef SHARDMUON_SHARDMUON_H_
#define SHARDMUON_SHARDMUON_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define SHARDMUON_API __declspec(dllexport)
#else
#define SHARDMUON_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SHARDMUON_VERSION_MAJOR 0
#define SHARDMUON_VERSION_MINOR 1
#define SHARDMUON_VERSION_PATCH 0

/* Bounds on arguments that size the library's own tables: past them a call would spend
 * minutes and gigabytes on its plan before failing (shardmuon_ns_options.num_iterations,
 * shardmuon_muon_param.row_blocks). */
#define SHARDMUON_MAX_NS_ITERATIONS 1000
#define SHARDMUON_MAX_ROW_BLOCKS 65536

/* ------------------------------------------------------------------------------------------ */
/* Status and errors                                                                           */
/* ------------------------------------------------------------------------------------------ */

typedef enum shardmuon_status {
  SHARDMUON_SUCCESS = 0,
  /* An argument is invalid; the message names it and its value. Nothing was modified. */
  SHARDMUON_ERROR_INVALID_ARGUMENT = 1,
  /* The library was built without the feature (CUDA, NCCL or MPI) the call needs. */
  SHARDMUON_ERROR_NOT_BUILT = 2,
  /* The combination is valid but not supported (for example float64 on the CUDA backend). */
  SHARDMUON_ERROR_UNSUPPORTED = 3,
  /* The ranks of the group passed arguments that disagree (shapes, dtype, layout, ...). */
  SHARDMUON_ERROR_RANK_MISMATCH = 4,
  /* Another rank of the group rejected its arguments; that rank's message says why. */
  SHARDMUON_ERROR_PEER_FAILED = 5,
  SHARDMUON_ERROR_OUT_OF_MEMORY = 6,
  SHARDMUON_ERROR_CUDA = 7,
  SHARDMUON_ERROR_CUBLAS = 8,
  SHARDMUON_ERROR_NCCL = 9,
  SHARDMUON_ERROR_MPI = 10,
  SHARDMUON_ERROR_INTERNAL = 11,
  /* The other ranks did not join the call's argument exchange in time (see
   * shardmuon_comm_set_timeout); the communicator handle is unusable afterwards. */
  SHARDMUON_ERROR_TIMEOUT = 12,
  /* A gradient or an update was not finite and the policy is RAISE. For a non-finite gradient
   * (or a set step flag) no parameter or momentum was written (the step flag holds the
   * verdict, and the skipped steps are counted); for a non-finite update, the parameters the
   * message names and their momentum were left as they were, the others were updated. */
  SHARDMUON_ERROR_NON_FINITE = 13
} shardmuon_status;

/* The message of the last failed call on this thread ("" if none). Valid until the next
 * shardmuon call on this thread. */
SHARDMUON_API const char* shardmuon_last_error(void);

/* A short constant name for a status, e.g. "SHARDMUON_ERROR_INVALID_ARGUMENT". */
SHARDMUON_API const char* shardmuon_status_name(shardmuon_status status);

SHARDMUON_API shardmuon_status shardmuon_version(int* major, int* minor, int* patch);

/* Which optional parts were compiled in: each out-parameter receives 1 or 0. Any may be NULL. */
SHARDMUON_API shardmuon_status shardmuon_build_info(int* has_cuda, int* has_nccl, int* has_mpi);

/* ------------------------------------------------------------------------------------------ */
/* Types                                                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef enum shardmuon_dtype {
  SHARDMUON_FLOAT32 = 0,
  SHARDMUON_BFLOAT16 = 1, /* bf16 storage; products accumulate in float32 */
  SHARDMUON_FLOAT64 = 2   /* CPU backend only: the reference precision */
} shardmuon_dtype;

typedef enum shardmuon_backend {
  SHARDMUON_BACKEND_CPU = 0, /* host memory, OpenBLAS; ranks communicate over MPI */
  SHARDMUON_BACKEND_CUDA = 1 /* device memory, cuBLASLt; ranks communicate over NCCL */
} shardmuon_backend;

typedef enum shardmuon_partition {
  SHARDMUON_REPLICATED = 0,   /* every rank holds the whole matrix */
  SHARDMUON_SHARDED_DIM0 = 1, /* contiguous blocks of rows (column-parallel Linear weight) */
  SHARDMUON_SHARDED_DIM1 = 2, /* contiguous blocks of columns (row-parallel Linear weight) */
  /* Contiguous ranges of the row-major matrix's elements, in rank order: what a rank holds of
   * a parameter when data-parallel (ZeRO / distributed-optimizer) sharding splits one flat
   * buffer of many parameters. A range may start and end inside a row. Orthogonalized by
   * DUPLICATED (one matrix) or by owners (a step); the Gram all-reduce needs DIM0 or DIM1. */
  SHARDMUON_SHARDED_FLAT = 3
} shardmuon_partition;

/* How a logical rows x cols matrix is spread over the ranks of a group. The local shard of
 * rank r is row-major and contiguous: shard_sizes[r] x cols for DIM0, rows x shard_sizes[r]
 * for DIM1, shard_sizes[r] elements for FLAT (shard_sizes count elements; NULL splits the
 * rows x cols elements evenly), the whole matrix when REPLICATED. Shards may be uneven and
 * may be empty. */
typedef struct shardmuon_layout {
  int64_t rows; /* logical (global) number of rows, >= 1 */
  int64_t cols; /* logical (global) number of columns, >= 1 */
  shardmuon_partition partition;
  /* Sharded layouts: number of shards, which must equal the communicator's size. */
  int num_shards;
  /* Sharded layouts: num_shards sizes along the sharded dim, in rank order, summing to rows
   * (DIM0) or cols (DIM1). NULL means a balanced split: the first (size % num_shards) ranks
   * get one more than the others. Ignored when REPLICATED. */
  const int64_t* shard_sizes;
} shardmuon_layout;

/* Coefficient schedules (a_k, b_k, c_k) of the Newton-Schulz iteration
 * X <- a X + b (X X^T) X + c (X X^T)^2 X. "Cycled" tables restart after their last entry;
 * "repeat last" tables keep using their last entry. */
typedef enum shardmuon_schedule {
  SHARDMUON_SCHEDULE_SIMPLE = 0,        /* (3.4445, -4.7750, 2.0315), cycled */
  SHARDMUON_SCHEDULE_QUINTIC = 1,       /* 5 entries, cycled */
  SHARDMUON_SCHEDULE_POLAR_EXPRESS = 2, /* 8 entries, repeat last (arXiv 2505.16932) */
  SHARDMUON_SCHEDULE_CANS = 3,          /* 5 entries, repeat last (arXiv 2506.10935) */
  SHARDMUON_SCHEDULE_AOL = 4,           /* 4 entries, cycled */
  SHARDMUON_SCHEDULE_CUSTOM = 5         /* one (a, b, c) per iteration, given by the caller */
} shardmuon_schedule;

/* How the orthogonalization of a sharded matrix is distributed (DESIGN.md section 3). */
typedef enum shardmuon_ns_algorithm {
  /* Let the library choose the distribution and, on it, the standard iteration, (e)'s or (c)'s
   * (below) by its cost model: (e) where the long side is well above the short one, (c) where
   * it is cheaper on a Gram summed over 2 or more ranks (large square matrices). The others
   * name the standard iteration, except GRAM_NEWTON_SCHULZ and GRAM_APPLIED_TWICE. */
  SHARDMUON_NS_AUTO = 0,
  /* (a) all-gather the matrix, run the whole iteration on every rank, keep the own shard. */
  SHARDMUON_NS_DUPLICATED = 1,
  /* (b) each rank keeps a block along the long side; every iteration all-reduces the small
   * Gram matrix. Shards along the short side are first moved to long-side blocks and back
   * by two all-to-alls ((d) of DESIGN.md). */
  SHARDMUON_NS_GRAM_ALLREDUCE = 2,
  /* (f) owner per matrix, for the parameters of a step (shardmuon_muon_step): each matrix
   * (each block of a stacked parameter) is assigned whole to one rank, balancing the ranks'
   * Newton-Schulz work; sharded matrices travel to their owners in one all-to-all for the
   * whole step and back in another; the owner orthogonalizes alone. A replicated parameter
   * under OWNER is taken to be a replica (the same values on every rank, as in data
   * parallelism): its owner orthogonalizes it and every rank receives that result by one
   * all-gather. Not for shardmuon_newton_schulz's single matrix. AUTO in a step uses it for
   * the sharded AUTO parameters when the cost model finds it cheaper than distributing each
   * matrix on its own. */
  SHARDMUON_NS_OWNER = 3,
  /* (e) Gram Newton-Schulz, on the distribution AUTO would choose for it: the iteration runs on the
   * s x s Gram matrix R = X X^T (Q_k = a_k I + b_k R_k + c_k R_k^2, R_{k+1} = Q_k R_k Q_k, M = Q_k
   * ... Q_0) and X <- M X is applied once at the end, so the long side is multiplied twice instead
   * of twice per iteration, and a sharded matrix needs one Gram all-reduce instead of one per
   * iteration. Exact in exact arithmetic; in bfloat16 and float32 it restarts from X every 2
   * iterations (M = Q_k ... Q_0 amplifies its rounding errors otherwise), which keeps it as
   * accurate as the standard iteration. AUTO chooses it where it is cheaper. */
  SHARDMUON_NS_GRAM_NEWTON_SCHULZ = 4,
  /* (c) the distribution of GRAM_ALLREDUCE, with each iteration applying the summed Gram A to
   * the rank's block twice instead of forming A A: X <- a X + b A X + c A (A X), computed as
   * Y = c (A - m I) X, X <- (A - m I) Y + d X with m = -b / (2c), d = a - b^2 / (4c) where c d
   * > 0 (no cancellation; otherwise Y = c A X + b X, X <- A Y + a X). Per rank of P and
   * iteration 5 s^2 L / P flops against 3 s^2 L / P + s^3 for (b), whose s^3 (A A) every rank
   * repeats: fewer where s > 2 L / P, so from 3 ranks on for square matrices. The same
   * communication as (b). On one rank (nothing to communicate) the whole matrix runs this
   * iteration. AUTO chooses it where the cost model finds it cheaper, never for the CANS
   * schedule, which it refuses (INVALID_ARGUMENT): near double roots of CANS's steps lose
   * bf16 accuracy in this form. */
  SHARDMUON_NS_GRAM_APPLIED_TWICE = 5,
  /* Reported by shardmuon_ns_plan only, never requested: */
  SHARDMUON_NS_LOCAL = 100, /* nothing to communicate: replicated, or a group of one */
  SHARDMUON_NS_GRAM_ALLREDUCE_REDISTRIBUTED = 101 /* (d): all-to-all, (b), all-to-all back */
} shardmuon_ns_algorithm;

typedef struct shardmuon_ns_options {
  int num_iterations; /* 1 <= K <= SHARDMUON_MAX_NS_ITERATIONS */
  shardmuon_schedule schedule;
  /* SHARDMUON_SCHEDULE_CUSTOM only: num_iterations triples a_0, b_0, c_0, a_1, ... */
  const double* custom_coefficients;
  int num_custom_coefficients; /* number of triples; must equal num_iterations */
  /* X = U / max(||U||_F, eps); eps >= 0. */
  double eps;
  shardmuon_ns_algorithm algorithm;
} shardmuon_ns_options;

/* Fills *options with the defaults: 5 iterations, quintic, eps 1e-7, automatic algorithm. */
SHARDMUON_API shardmuon_status shardmuon_ns_options_default(shardmuon_ns_options* options);

/* Parses a schedule name ("simple", "quintic", "polar_express", "cans", "aol", "custom"). */
SHARDMUON_API shardmuon_status shardmuon_schedule_from_name(const char* name,
                                                            shardmuon_schedule* schedule);

/* The (a, b, c) that the schedule uses at iteration k (0-based) of num_iterations. For the
 * custom schedule pass the options; otherwise options may be NULL. */
SHARDMUON_API shardmuon_status shardmuon_schedule_coefficients(shardmuon_schedule schedule,
                                                               int iteration,
                                                               const shardmuon_ns_options* options,
                                                               double* a, double* b, double* c);

/* ------------------------------------------------------------------------------------------ */
/* Handles                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* A context owns the compute resources of one backend: for CUDA, the device, a cuBLASLt
 * handle and a workspace that grows to the largest call and never shrinks. A context may be
 * used from one host thread at a time. The CUDA backend records the work of a matrix's
 * Newton-Schulz iteration on one rank (a local plan, or the duplicated algorithm after its
 * all-gather) into a CUDA graph the second time it meets the same problem on the same memory,
 * and from then on launches that graph: the same kernels, one launch for the host. Calls
 * inside a caller's own capture are not recorded; the environment variable
 * SHARDMUON_NS_GRAPHS=0, read when the context is created, turns recording off. */
typedef struct shardmuon_context_s* shardmuon_context_t;

/* A communicator: the group of ranks that share the sharded matrices. */
typedef struct shardmuon_comm_s* shardmuon_comm_t;

/* What a Muon step does with values that are not finite. */
typedef enum shardmuon_nonfinite_policy {
  /* The default. A NaN or Inf in any gradient of a step, on any rank, skips the whole step on
   * every rank: no parameter and no momentum changes. Otherwise a parameter whose
   * orthogonalized update is not finite is skipped (its parameter and momentum unchanged).
   * Detected on the device, without waiting for it; shardmuon_context_nonfinite_counts says
   * how often it happened. */
  SHARDMUON_NONFINITE_SKIP = 0,
  /* As SKIP, and the step returns SHARDMUON_ERROR_NON_FINITE naming the parameters; the host
   * waits for the step's end to know. */
  SHARDMUON_NONFINITE_RAISE = 1,
  /* No check: non-finite values reach momentum and parameters (the fastest path). The
   * momentum is updated in place before the orthogonalization's collectives: a step that
   * fails in them (a communicator's error) returns with the momentum advanced and the
   * parameters not, where SKIP and RAISE leave both as they were. */
  SHARDMUON_NONFINITE_PROCEED = 2
} shardmuon_nonfinite_policy;

/* cuda_device is ignored for the CPU backend. */
SHARDMUON_API shardmuon_status shardmuon_context_create(shardmuon_backend backend, int cuda_device,
                                                        shardmuon_context_t* context);
/* Waits for the context's outstanding GPU work, then frees it and the buffers of
 * shardmuon_buffer_create it still holds. NULL is a no-op. */
SHARDMUON_API shardmuon_status shardmuon_context_destroy(shardmuon_context_t context);
SHARDMUON_API shardmuon_status shardmuon_context_backend(shardmuon_context_t context,
                                                         shardmuon_backend* backend);
SHARDMUON_API shardmuon_status shardmuon_context_set_nonfinite_policy(
    shardmuon_context_t context, shardmuon_nonfinite_policy policy);

#define SHARDMUON_DEFAULT_NS_BATCH_BYTES ((size_t)256 << 20)

/* The most workspace one strided batch of Newton-Schulz may take, in bytes (default
 * SHARDMUON_DEFAULT_NS_BATCH_BYTES, 256 MiB).
 * The matrices of one shape and plan that a rank orthogonalizes by itself (a model's layers
 * of one shape, experts, heads) run as strided batches of as many matrices as fit in it, at
 * least one. Larger batches launch fewer, larger products: on an H200, 1 GiB made the
 * captured steps of GPT-2 medium and XL 1-3% faster and XL's eager step 4%
 * (docs/BENCHMARKS.md), for up to 768 MiB more workspace; 0 runs every matrix by itself.
 * Every rank of a step must use the same value (it enters the arguments the ranks compare:
 * replicated matrices must get the same kernels everywhere). */
SHARDMUON_API shardmuon_status shardmuon_context_set_ns_batch_bytes(shardmuon_context_t context,
                                                                    size_t bytes);

/* Steps skipped because a gradient was not finite, and parameters skipped because their
 * update was not finite, by the context's Muon steps so far. Waits for the context's device
 * work. */
SHARDMUON_API shardmuon_status shardmuon_context_nonfinite_counts(shardmuon_context_t context,
                                                                  int64_t* skipped_steps,
                                                                  int64_t* skipped_params);

/* A float shared between the context's checked steps (SKIP or RAISE) and what runs beside
 * them, such as another optimizer over the model's other parameters, or a mixed-precision loss
 * scaler's found_inf: on the context's device (host memory for the CPU backend), 4-byte
 * aligned. A checked step reads it, in stream order, as one more gradient of this rank: a
 * non-zero value skips the step on every rank of its communicator, as a non-finite gradient
 * would (and RAISE reports it). The step then writes there whether it was skipped: non-zero if
 * so, else 0. So a caller that sets it to whether its own gradients are finite before the step
 * reads after the step whether to skip its own update, without the host waiting in between; a
 * second step over another communicator that reads the first's verdict skips too. A step under
 * PROCEED neither reads nor writes it. NULL (the default): none. The context keeps the pointer,
 * not the value: it must stay valid while steps run, and a step captured into a CUDA graph
 * reads and writes it at every replay. */
SHARDMUON_API shardmuon_status shardmuon_context_set_step_flag(shardmuon_context_t context,
                                                               float* flag);

/* For a step whose parameters are split over several communicators (a device mesh's
 * dimensions: one shardmuon_muon_step per communicator): replaces the context's step flag with
 * the number of ranks of comm whose flag is set (non-zero, NaN included; so flags of opposite
 * signs cannot cancel; 0 or 1 on a communicator of one rank), in stream order, once the ranks have
 * agreed that each of them makes this call under the same non-finite policy. Made over each
 * communicator in turn, before the first step, with the flag holding whether anything of this
 * rank's whole step is not finite, it leaves every rank of a mesh the same flag (for communicators
 * along its dimensions), so that all the steps skip or none does: without it, a step reads only its
 * own communicator's gradients and the verdicts of the steps before it, and the steps before a
 * non-finite gradient's would already have written. A rank that failed before this call calls
 * shardmuon_muon_step with a negative num_params here instead, and the others' calls return
 * SHARDMUON_ERROR_PEER_FAILED; a rank told so does the same over the communicators after. So a
 * failure found on one rank ends the whole step on every rank before anything is written,
 * instead of stranding the ranks of the later communicators.
 * Under PROCEED only the agreement is made. A checked policy needs a step flag
 * (shardmuon_context_set_step_flag). Captured into a CUDA graph, the ranks cannot compare
 * (the steps captured after it compare themselves with their last uncaptured step). */
SHARDMUON_API shardmuon_status shardmuon_context_reduce_step_flag(shardmuon_context_t context,
                                                                  shardmuon_comm_t comm,
                                                                  void* stream);

/* Bytes of workspace the context currently holds. */
SHARDMUON_API shardmuon_status shardmuon_context_workspace_bytes(shardmuon_context_t context,
                                                                 size_t* bytes);

/* Memory in the context's backend (device memory of its GPU, or host memory), zero-filled,
 * for buffers the library owns on a caller's behalf (the C++ Muon class's momentum).
 * Allocation synchronizes with the device; meant for set-up, not for every step. */
SHARDMUON_API shardmuon_status shardmuon_buffer_create(shardmuon_context_t context, size_t bytes,
                                                       void** buffer);
/* Frees a buffer of shardmuon_buffer_create after the device work using it. NULL is a no-op;
 * a pointer that is not a live buffer of this context's (freed already, or made otherwise) is
 * refused with INVALID_ARGUMENT. */
SHARDMUON_API shardmuon_status shardmuon_buffer_destroy(shardmuon_context_t context, void* buffer);

/* A group of one rank (no communication); works with every backend. */
SHARDMUON_API shardmuon_status shardmuon_comm_create_self(shardmuon_comm_t* comm);

/* Wraps an MPI communicator for the CPU backend. mpi_comm is the address of an MPI_Comm
 * (mpi4py: MPI._addressof(comm)). Collective over that communicator: it is duplicated, so
 * shardmuon's messages never mix with the caller's. MPI must be initialized. */
SHARDMUON_API shardmuon_status shardmuon_comm_create_mpi(const void* mpi_comm,
                                                         shardmuon_comm_t* comm);

/* Wraps (borrows) a caller's ncclComm_t for the CUDA backend; the caller keeps ownership and
 * must keep it alive while the handle lives. Collective: it splits off a private NCCL
 * communicator used only for the cross-rank argument check, so that check never waits
 * behind the caller's own NCCL work. */
SHARDMUON_API shardmuon_status shardmuon_comm_create_nccl(void* nccl_comm, shardmuon_comm_t* comm);

/* A communicator whose collectives the caller implements (a framework's own process group,
 * say PyTorch's gloo). Each function returns 0 on success, anything else on failure (the call
 * then fails with SHARDMUON_ERROR_INTERNAL naming the operation). Buffers are in the memory of
 * `backend` (host memory for the CPU backend); stream is the call's stream. Every rank of the
 * group makes the same calls in the same order. A step captured into a CUDA graph
 * (shardmuon_muon_step) calls them while `stream` is being captured: they must then only
 * enqueue work on it, not synchronize it (a copy staged through host memory cannot be
 * captured, and the step then fails naming the callback). */
typedef struct shardmuon_comm_callbacks {
  void* user_data; /* passed back to every function */
  int rank;
  int size;
  /* In place, element-wise sum of count values of dtype (FLOAT32 or FLOAT64). */
  int (*all_reduce_sum)(void* user_data, void* buffer, int64_t count, shardmuon_dtype dtype,
                        void* stream);
  /* buffer holds size blocks of block_bytes; block `rank` is this rank's; fill all others. */
  int (*all_gather)(void* user_data, void* buffer, size_t block_bytes, void* stream);
  /* Send send_bytes[r] bytes at send + send_offsets[r] to rank r; receive recv_bytes[r] bytes
   * from rank r at recv + recv_offsets[r]. */
  int (*all_to_all)(void* user_data, const void* send, const size_t* send_bytes,
                    const size_t* send_offsets, void* recv, const size_t* recv_bytes,
                    const size_t* recv_offsets, void* stream);
  /* Host memory, blocking: element-wise maximum of count int64 values over the group. */
  int (*agree_max)(void* user_data, int64_t* values, int count);
} shardmuon_comm_callbacks;

/* The callbacks are copied; user_data must outlive the handle. */
SHARDMUON_API shardmuon_status shardmuon_comm_create_callbacks(
    const shardmuon_comm_callbacks* callbacks, shardmuon_backend backend, shardmuon_comm_t* comm);

/* How long a collective call waits, in its argument exchange (the first thing every collective
 * call does), for the other ranks to join: after that it returns SHARDMUON_ERROR_TIMEOUT on the
 * ranks that did join, and the handle is unusable (destroy it; the caller's communicator is not
 * touched). 0 waits forever. The default is 300
 * seconds, or $SHARDMUON_TIMEOUT_SECONDS when set. Once every rank has joined, the ranks agree
 * on every argument, so the call's collectives match; a rank that dies during them is left to
 * the caller's NCCL watchdog (PyTorch's, for example). Callback communicators time out in the
 * caller's own collectives. */
SHARDMUON_API shardmuon_status shardmuon_comm_set_timeout(shardmuon_comm_t comm, double seconds);

/* Frees the handle (and the private resources it made); the wrapped communicator remains
 * the caller's. NULL is a no-op. */
SHARDMUON_API shardmuon_status shardmuon_comm_destroy(shardmuon_comm_t comm);
SHARDMUON_API shardmuon_status shardmuon_comm_rank(shardmuon_comm_t comm, int* rank);
SHARDMUON_API shardmuon_status shardmuon_comm_size(shardmuon_comm_t comm, int* size);

/* ------------------------------------------------------------------------------------------ */
/* Newton-Schulz orthogonalization                                                             */
/* ------------------------------------------------------------------------------------------ */

/* Orthogonalizes, in place on every rank's local shard, the logical matrix U described by
 * layout:
 *   X = U / max(||U||_F, eps)            (norm over all shards, accumulated in float32 or
 *                                         float64 and all-reduced)
 *   for k = 0..K-1: A = X X^T; X <- a_k X + b_k A X + c_k A A X
 * computed in whichever orientation has the smaller Gram matrix (p(XX^T)X = X p(X^TX)).
 * The result equals the same computation on the gathered matrix up to rounding. The input is
 * not checked for NaN or Inf (shardmuon_muon_step checks its gradients, see
 * shardmuon_nonfinite_policy): one anywhere in U makes every element of every rank's result
 * NaN (tested on the CPU backend, 1-4 ranks), never a result that looks valid in part.
 *
 * local_shard: this rank's shard (see shardmuon_layout), in the backend's memory, aligned to
 *   its element size. May be NULL only when the local shard is empty.
 * stream: the caller's cudaStream_t for the CUDA backend, where all the work is enqueued
 *   (NULL is the legacy default stream, as PyTorch's default stream is); ignored by the CPU
 *   backend, which computes before returning.
 *
 * Collective over comm. Before any collective, the ranks exchange a digest of their
 * arguments; if one rank's arguments are invalid, or the ranks disagree, every rank returns
 * an error (INVALID_ARGUMENT on the rank at fault, PEER_FAILED or RANK_MISMATCH on the others)
 * and no rank's shard is modified. Not capturable into a CUDA graph (it returns UNSUPPORTED
 * on a capturing stream); shardmuon_muon_step is. */
SHARDMUON_API shardmuon_status shardmuon_newton_schulz(
    shardmuon_context_t context, shardmuon_comm_t comm, void* local_shard, shardmuon_dtype dtype,
    const shardmuon_layout* layout, const shardmuon_ns_options* options, void* stream);

/* The size and, if field is not NULL, the offset of a field of one of this header's structs,
 * by name ("shardmuon_muon_param", "layout" ...), so that bindings written in other
 * languages (the Python package's ctypes structs) can check their layout against the
 * library's. INVALID_ARGUMENT for an unknown name. */
SHARDMUON_API shardmuon_status shardmuon_abi_layout(const char* type, const char* field,
                                                    size_t* size, size_t* offset);

/* The algorithm shardmuon_newton_schulz would run for these arguments on a group of
 * comm_size ranks: AUTO resolved, and LOCAL or GRAM_ALLREDUCE_REDISTRIBUTED where they
 * apply. Local; no communication. */
SHARDMUON_API shardmuon_status shardmuon_ns_plan(const shardmuon_layout* layout, int comm_size,
                                                 const shardmuon_ns_options* options,
                                                 shardmuon_ns_algorithm* chosen);

/* Whether that plan runs (e)'s Gram iteration on its distribution (*gram_iteration = 1) or
 * the standard iteration (0): always 1 for GRAM_NEWTON_SCHULZ, never for DUPLICATED and
 * GRAM_ALLREDUCE; for AUTO, 1 where the cost model finds (e) cheaper (a long side well above
 * the short one). Local; no communication. */
SHARDMUON_API shardmuon_status shardmuon_ns_plan_gram_iteration(const shardmuon_layout* layout,
                                                                int comm_size,
                                                                const shardmuon_ns_options* options,
                                                                int* gram_iteration);

/* Whether that plan runs (c)'s iteration (*applied_twice = 1) or not (0): always 1 for
 * GRAM_APPLIED_TWICE, never for DUPLICATED, GRAM_ALLREDUCE and GRAM_NEWTON_SCHULZ; for AUTO, 1
 * where the cost model finds it cheaper on a Gram summed over the group. Local; no
 * communication. */
SHARDMUON_API shardmuon_status shardmuon_ns_plan_applied_twice(const shardmuon_layout* layout,
                                                               int comm_size,
                                                               const shardmuon_ns_options* options,
                                                               int* applied_twice);

/* The planner's estimate, in seconds, of the plan shardmuon_ns_plan and
 * shardmuon_ns_plan_gram_iteration report for these arguments: its cost model of bf16 on
 * H200-class GPUs over NVLink (docs/DESIGN_NOTES.md), not a measurement; (e) restarting as
 * bf16 does. Local; no communication. */
SHARDMUON_API shardmuon_status shardmuon_ns_estimate(const shardmuon_layout* layout, int comm_size,
                                                     const shardmuon_ns_options* options,
                                                     double* seconds);

/* ------------------------------------------------------------------------------------------ */
/* The Muon optimizer step                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* How weight decay enters the step (DESIGN.md section 1, step 1). */
typedef enum shardmuon_weight_decay {
  SHARDMUON_WEIGHT_DECAY_DECOUPLED = 0,   /* W <- W (1 - lr wd) */
  SHARDMUON_WEIGHT_DECAY_L2 = 1,          /* G <- G + wd W (the caller's grad is not written) */
  SHARDMUON_WEIGHT_DECAY_INDEPENDENT = 2, /* W <- W (1 - wd) */
  SHARDMUON_WEIGHT_DECAY_NONE = 3
} shardmuon_weight_decay;

/* The scale of the orthogonalized update, from the logical shape m x n (rows x cols). */
typedef enum shardmuon_scale_mode {
  SHARDMUON_SCALE_SPECTRAL = 0,      /* sqrt(max(m, n)) */
  SHARDMUON_SCALE_SHAPE_SCALING = 1, /* sqrt(max(1, m / n)) */
  SHARDMUON_SCALE_UNIT_RMS_NORM = 2, /* sqrt(m / n) */
  SHARDMUON_SCALE_NONE = 3           /* 1 */
} shardmuon_scale_mode;

/* The storage dtype of a group's Newton-Schulz iteration (products accumulate in float32
 * either way). Parameter, gradient and momentum keep their own dtype: only the update U is
 * rounded to this dtype before the iteration, and O is read back from it by the final pass. */
typedef enum shardmuon_ns_storage {
  /* The parameter's dtype (the zero-initialized value): float32 parameters get a float32
   * iteration, the most accurate and on an H200 about 10x slower than bf16. */
  SHARDMUON_NS_STORAGE_PARAM = 0,
  /* bf16, for any parameter: what torch.optim.Muon and most Muon code do (they round the
   * update to bf16 for the iteration), with float32 weights and momentum. Half the bytes to
   * move and the tensor cores' bf16 rate, at bf16 accuracy of the update (DESIGN_NOTES). */
  SHARDMUON_NS_STORAGE_BFLOAT16 = 1,
  /* float32, for any parameter: a more accurate update for bf16 weights. */
  SHARDMUON_NS_STORAGE_FLOAT32 = 2
} shardmuon_ns_storage;

/* The hyperparameters of a parameter group. One step, per parameter W with gradient G and
 * momentum buffer M:
 *   weight decay (see shardmuon_weight_decay);
 *   M <- lerp(M, G, 1 - momentum);
 *   U = nesterov ? lerp(G, M, momentum) : M            (a new buffer; M is not touched again)
 *   O = NewtonSchulz(U)                                  (ns, in the parameter's layout,
 *                                                         stored as ns_storage says)
 *   W <- W - lr * extra_scale_factor * scale(m, n) * O */
typedef struct shardmuon_muon_group {
  double lr;       /* may change every step */
  double momentum; /* beta, in [0, 1) */
  int nesterov;    /* 0 or 1 */
  double weight_decay;
  shardmuon_weight_decay weight_decay_mode;
  shardmuon_scale_mode scale_mode;
  double extra_scale_factor; /* 0.2 with SPECTRAL is the Moonlight "match AdamW RMS" rule */
  shardmuon_ns_options ns;
  /* NULL (the zero-initialized value), or a float32 learning rate in the context's memory
   * (device memory on CUDA, 4-byte aligned) that the step reads when its kernels run, in
   * place of lr (which is then ignored): a schedule can change it between replays of a
   * captured step by writing it on the stream. The value must be finite and >= 0 (it is not
   * checked: reading it would wait on the device). Checkpoints record lr, not this value. */
  const float* lr_on_device;
  shardmuon_ns_storage ns_storage; /* PARAM (0): the parameter's dtype */
} shardmuon_muon_group;

/* Fills *group with TransformerEngine's defaults: lr 3e-4, momentum 0.95, Nesterov,
 * weight decay 0.01 decoupled, spectral scale, extra_scale_factor 1,
 * shardmuon_ns_options_default (quintic, 5 steps, eps 1e-7), and the iteration in the
 * parameter's dtype (ns_storage PARAM). */
SHARDMUON_API shardmuon_status shardmuon_muon_group_default(shardmuon_muon_group* group);

/* One parameter of a step. The three buffers are this rank's shards in the layout, of one
 * dtype, owned by the caller, and must not overlap. A rank whose shard is empty may pass NULL
 * for all three. */
typedef struct shardmuon_muon_param {
  void* param;
  const void* grad;
  void* momentum;
  shardmuon_dtype dtype; /* of param, grad and momentum */
  shardmuon_layout layout;
  int group; /* index into the groups of the step */
  /* 1: the parameter has no gradient this step; it is skipped and its momentum left as it
   * is (grad and momentum are not read, and may be NULL). Every rank of the communicator must say
   * the same (checked: a rank that disagrees makes every rank return RANK_MISMATCH). 0, the
   * zero-initialized value, means grad is this step's gradient. */
  int no_grad;
  /* The matrix is row_blocks matrices stacked along dim 0, each (rows / row_blocks) x cols,
   * orthogonalized (and scaled) each on its own: the experts of a mixture-of-experts weight
   * (E x m x n seen as (E m) x n), or a fused weight split by head or by part (QKV with
   * row_blocks = the number of heads of head_dim rows; gate and up with row_blocks = 2).
   * rows must be a multiple of it, and it at most SHARDMUON_MAX_ROW_BLOCKS. 0, the
   * zero-initialized value, means 1: one matrix. */
  int64_t row_blocks;
} shardmuon_muon_param;

/* One Muon step over a batch of parameters, in place on param and momentum; grad is only
 * read. Collective over comm: every rank passes the same parameters (shapes, layouts, dtypes,
 * groups, which grads are absent) and the same hyperparameters, in the same order, each with
 * its own shards; the ranks check this before any collective, and any invalid argument or
 * disagreement makes every rank return an error with nothing modified. Elementwise work is
 * fused on the GPU: one pass for weight decay + momentum + Nesterov, one for scale + update.
 *
 * CUDA graphs: a step may be captured (cudaStreamBeginCapture on `stream`, any capture mode;
 * torch.cuda.graph) once the same step, with the same parameters, layouts and hyperparameters,
 * has run uncaptured on this comm and context. The captured step neither checks arguments
 * across ranks (that waits on the host) nor allocates: it must repeat the last uncaptured
 * step's arguments on this comm; where their shapes, layouts, dtypes or hyperparameters differ
 * it returns INVALID_ARGUMENT on this rank (the other ranks cannot know, so keep the arguments
 * equal everywhere; buffer addresses are not compared). Replays use the captured buffers and
 * hyperparameters, the learning rate included unless a group reads it from device memory
 * (lr_on_device); copy new gradients into the same buffers between replays. The non-finite
 * policy must be SKIP or PROCEED (RAISE waits on the host). After a capture the context's
 * workspace never moves, so a later call that needs a larger one fails: capture after the
 * context's largest call. */
SHARDMUON_API shardmuon_status shardmuon_muon_step(
    shardmuon_context_t context, shardmuon_comm_t comm, const shardmuon_muon_param* params,
    int num_params, const shardmuon_muon_group* groups, int num_groups, void* stream);

/* How shardmuon_muon_step would distribute these parameters' orthogonalization on this
 * communicator, without running it or communicating (arguments are checked as by the step,
 * on this rank only). For each parameter, algorithms[i] is one of LOCAL, DUPLICATED,
 * GRAM_ALLREDUCE, GRAM_ALLREDUCE_REDISTRIBUTED or OWNER (for a stacked parameter, its first
 * block's), and owners[i] the rank that orthogonalizes it under OWNER (its first block's),
 * else -1. A parameter without gradient, which the step skips, reports the plan it would have
 * on its own: it is never in the owners' batch (OWNER is not reported for it, and owners[i] is
 * -1). Either output may be NULL. */
SHARDMUON_API shardmuon_status shardmuon_muon_plan(
    shardmuon_context_t context, shardmuon_comm_t comm, const shardmuon_muon_param* params,
    int num_params, const shardmuon_muon_group* groups, int num_groups,
    shardmuon_ns_algorithm* algorithms, int* owners);

/* Whether shardmuon_muon_step would run each parameter's Newton-Schulz as (e)'s Gram iteration
 * (gram_iteration[i] = 1) or as the standard iteration (0), on the distribution
 * shardmuon_muon_plan reports: under OWNER the owner's run on the whole matrix, for a stacked
 * parameter its first block's. Always 1 where a group asks for GRAM_NEWTON_SCHULZ on one
 * matrix, 0 under DUPLICATED or GRAM_ALLREDUCE; under AUTO, and for owners, the cost model's
 * choice. Checked and computed as shardmuon_muon_plan, without communicating. */
SHARDMUON_API shardmuon_status shardmuon_muon_plan_gram_iteration(
    shardmuon_context_t context, shardmuon_comm_t comm, const shardmuon_muon_param* params,
    int num_params, const shardmuon_muon_group* groups, int num_groups, int* gram_iteration);

/* Whether shardmuon_muon_step would run each parameter's Newton-Schulz as (c)'s iteration, the
 * summed Gram applied twice (applied_twice[i] = 1), or not (0), on the distribution
 * shardmuon_muon_plan reports (which names (c)'s GRAM_ALLREDUCE, GRAM_ALLREDUCE_REDISTRIBUTED
 * for short-side shards, or LOCAL on one rank or for a replicated parameter); for a stacked
 * parameter its first block's. Always 1 where a group asks for GRAM_APPLIED_TWICE, never under
 * DUPLICATED, GRAM_ALLREDUCE or GRAM_NEWTON_SCHULZ, nor under OWNER for a parameter with a
 * gradient (an owner runs the standard iteration or (e)); under AUTO, and under OWNER for a
 * parameter without gradient (planned on its own, see shardmuon_muon_plan), the cost model's
 * choice, as shardmuon_ns_plan_applied_twice reports for the parameter's layout. Checked and
 * computed as shardmuon_muon_plan, without communicating. */
SHARDMUON_API shardmuon_status shardmuon_muon_plan_applied_twice(
    shardmuon_context_t context, shardmuon_comm_t comm, const shardmuon_muon_param* params,
    int num_params, const shardmuon_muon_group* groups, int num_groups, int* applied_twice);

/* ------------------------------------------------------------------------------------------ */
/* Optimizer checkpoints                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* The state of a Muon optimizer: each parameter's momentum buffer (with its logical shape and
 * this rank's place in it), the step count and the groups' hyperparameters. The format is
 * documented in docs/CHECKPOINT.md: one safetensors file per rank plus an index written last,
 * each file replaced atomically (temporary file, then rename), with a CRC-32 per tensor.
 * Loading does not depend on how the state was sharded when saved: a checkpoint saved on 2
 * ranks loads on 1 or on 3, with other shard sizes or another partition. */

/* Writes the state into directory (created if missing). Collective over comm. names are the
 * parameters' unique names (at most 200 bytes of [A-Za-z0-9_.-]); grad pointers are ignored,
 * and every parameter's momentum is saved, a parameter marked no_grad's too (where its local
 * shard is not empty, its momentum and param must be valid buffers here and in
 * shardmuon_muon_load). Blocks until the files are written; the device work already on stream
 * is waited for. */
SHARDMUON_API shardmuon_status shardmuon_muon_save(shardmuon_context_t context,
                                                   shardmuon_comm_t comm, const char* directory,
                                                   const shardmuon_muon_param* params,
                                                   const char* const* names, int num_params,
                                                   const shardmuon_muon_group* groups,
                                                   int num_groups, int64_t step, void* stream);

/* Reads the state saved in directory into the momentum buffers of params (matched by name;
 * the layouts and dtypes may differ from the saved ones), and returns the step count and,
 * if groups is not NULL, the saved hyperparameters (num_groups must match the saved count).
 * groups is an output: its hyperparameters are neither read nor checked (a zero-initialized
 * array will do); only the pointers a checkpoint cannot hold are kept from it, lr_on_device
 * (with lr where the saved group recorded none) and, for a group saved with a custom
 * schedule, ns.custom_coefficients, which must hold the saved coefficients. The saved groups
 * are checked against params as a step checks its groups (a group whose algorithm a
 * parameter's layout now cannot run is refused).
 * Collective over comm. Everything is read and checked (sizes, checksums, coverage of every
 * parameter) before any buffer is written: on any error every rank returns it and no
 * momentum buffer, step or group is modified. */
SHARDMUON_API shardmuon_status shardmuon_muon_load(shardmuon_context_t context,
                                                   shardmuon_comm_t comm, const char* directory,
                                                   const shardmuon_muon_param* params,
                                                   const char* const* names, int num_params,
                                                   shardmuon_muon_group* groups, int num_groups,
                                                   int64_t* step, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHARDMUON_SHARDMUON_H_ */
