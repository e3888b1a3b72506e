#include "harness.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

#ifdef SHARDMUON_TEST_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace shardmuon_test {
namespace {

std::unique_ptr<Harness> instance;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("test harness: " + what);
}

#ifdef SHARDMUON_TEST_WITH_CUDA
void cuda_ok(cudaError_t code, const char* what) {
  require(code == cudaSuccess, std::string(what) + ": " + cudaGetErrorString(code));
}
void nccl_ok(ncclResult_t code, const char* what) {
  require(code == ncclSuccess, std::string(what) + ": " + ncclGetErrorString(code));
}
#endif

}  // namespace

Buffer::Buffer(size_t bytes, bool on_device) : bytes_(bytes), on_device_(on_device) {
  if (bytes == 0) return;
  if (on_device) {
#ifdef SHARDMUON_TEST_WITH_CUDA
    cuda_ok(cudaMalloc(&data_, bytes), "cudaMalloc");
#endif
  } else {
    data_ = std::malloc(bytes);
  }
}

Buffer::~Buffer() {
  if (data_ == nullptr) return;
#ifdef SHARDMUON_TEST_WITH_CUDA
  if (on_device_) {
    cudaFree(data_);
    return;
  }
#endif
  std::free(data_);
}

Buffer::Buffer(Buffer&& other) noexcept {
  *this = std::move(other);
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  std::swap(on_device_, other.on_device_);
  return *this;
}

void Harness::initialize(shardmuon_backend backend, CommKind comm_kind) {
  instance = std::make_unique<Harness>();
  Harness& h = *instance;
  h.backend_ = backend;
  h.comm_kind_ = comm_kind;
  MPI_Comm_rank(MPI_COMM_WORLD, &h.world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &h.world_size_);

  int max_size = h.world_size_;
  int device = 0;
  if (backend == SHARDMUON_BACKEND_CUDA) {
#ifdef SHARDMUON_TEST_WITH_CUDA
    const bool over_nccl = comm_kind == CommKind::kNative;
    int devices = 0;
    cuda_ok(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    require(devices >= 1, "no CUDA device");
    // NCCL refuses two ranks on one GPU of one host; ranks given different NCCL_HOSTIDs are
    // on different hosts to it, and connect over its network transport (scripts/gpu_check.sh
    // runs them so where one GPU is lent). The staged callbacks do not mind.
    const char* host_id = std::getenv("NCCL_HOSTID");
    require(!over_nccl || h.world_size_ <= devices || (host_id != nullptr && *host_id != 0),
            "more ranks than GPUs: run one rank per GPU, pass --comm=callbacks, or give each "
            "rank its own NCCL_HOSTID");
    device = h.world_rank_ % devices;
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    h.stream_ = stream;
    if (over_nccl) {
      ncclUniqueId id;
      if (h.world_rank_ == 0) nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
      MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
      ncclComm_t world = nullptr;
      nccl_ok(ncclCommInitRank(&world, h.world_size_, id, h.world_rank_), "ncclCommInitRank");
      h.nccl_world_ = world;
    }
#else
    require(false, "the tests were built without CUDA");
#endif
  }
  shardmuon_status status = shardmuon_context_create(backend, device, &h.context_);
  require(status == SHARDMUON_SUCCESS, std::string("context: ") + shardmuon_last_error());
  h.device_ = device;

  for (int size = 1; size <= max_size; ++size) {
    Group group;
    group.size = size;
    group.member = h.world_rank_ < size;
    MPI_Comm_split(MPI_COMM_WORLD, group.member ? 0 : MPI_UNDEFINED, h.world_rank_, &group.mpi);
    if (comm_kind == CommKind::kCallbacks) {
      if (group.member) {
        h.callbacks_.push_back(std::make_unique<MpiCallbacks>(group.mpi, h.on_gpu()));
        const shardmuon_comm_callbacks table = h.callbacks_.back()->table();
        status = shardmuon_comm_create_callbacks(&table, backend, &group.comm);
        require(status == SHARDMUON_SUCCESS,
                std::string("callback comm: ") + shardmuon_last_error());
      }
    } else if (backend == SHARDMUON_BACKEND_CPU) {
      if (group.member) {
        status = shardmuon_comm_create_mpi(&group.mpi, &group.comm);
        require(status == SHARDMUON_SUCCESS, std::string("mpi comm: ") + shardmuon_last_error());
      }
    } else {
#ifdef SHARDMUON_TEST_WITH_CUDA
      ncclComm_t sub = nullptr;
      nccl_ok(ncclCommSplit(static_cast<ncclComm_t>(h.nccl_world_),
                            group.member ? 0 : NCCL_SPLIT_NOCOLOR, h.world_rank_, &sub, nullptr),
              "ncclCommSplit");
      h.nccl_groups_.push_back(sub);
      if (group.member) {
        status = shardmuon_comm_create_nccl(sub, &group.comm);
        require(status == SHARDMUON_SUCCESS, std::string("nccl comm: ") + shardmuon_last_error());
      }
#endif
    }
    if (group.member) MPI_Comm_rank(group.mpi, &group.rank);
    h.groups_.push_back(group);
  }
}

void Harness::shutdown() {
  if (!instance) return;
  Harness& h = *instance;
  for (Group& group : h.groups_) {
    shardmuon_comm_destroy(group.comm);
    if (group.mpi != MPI_COMM_NULL) MPI_Comm_free(&group.mpi);
  }
  h.callbacks_.clear();
  shardmuon_context_destroy(h.context_);
#ifdef SHARDMUON_TEST_WITH_CUDA
  for (void* sub : h.nccl_groups_) {
    if (sub != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(sub));
  }
  if (h.nccl_world_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(h.nccl_world_));
  if (h.stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(h.stream_));
#endif
  instance.reset();
}

Harness& Harness::get() {
  return *instance;
}

Buffer Harness::upload(const std::vector<unsigned char>& bytes) const {
  Buffer buffer(bytes.size(), on_gpu());
  upload_into(buffer.data(), bytes);
  return buffer;
}

void Harness::upload_into(void* data, const std::vector<unsigned char>& bytes) const {
  if (bytes.empty()) return;
  if (on_gpu()) {
#ifdef SHARDMUON_TEST_WITH_CUDA
    cuda_ok(cudaMemcpyAsync(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice,
                            static_cast<cudaStream_t>(stream_)),
            "upload");
    synchronize();
#endif
  } else {
    std::memcpy(data, bytes.data(), bytes.size());
  }
}

std::vector<unsigned char> Harness::download(const Buffer& buffer) const {
  return download(buffer.data(), buffer.bytes());
}

std::vector<unsigned char> Harness::download(const void* data, size_t size) const {
  synchronize();
  std::vector<unsigned char> bytes(size);
  if (bytes.empty()) return bytes;
  if (on_gpu()) {
#ifdef SHARDMUON_TEST_WITH_CUDA
    cuda_ok(cudaMemcpy(bytes.data(), data, bytes.size(), cudaMemcpyDeviceToHost), "download");
#endif
  } else {
    std::memcpy(bytes.data(), data, bytes.size());
  }
  return bytes;
}

void Harness::synchronize() const {
#ifdef SHARDMUON_TEST_WITH_CUDA
  if (on_gpu()) cuda_ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "sync");
#endif
}

void DistributedTest::TearDown() {
  int failed = HasFailure() ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_failed && !failed) ADD_FAILURE() << "another rank failed this test (its output says why)";
}

bool for_each_group(int first_size, const std::function<void(const Group&)>& body) {
  const Harness& harness = Harness::get();
  for (int size = first_size; size <= harness.max_group_size(); ++size) {
    const Group& group = harness.group(size);
    if (group.member) body(group);
    int failed = ::testing::Test::HasFatalFailure() ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (failed) return false;
  }
  return true;
}

double group_relative_error(const std::vector<double>& x, const std::vector<double>& reference,
                            MPI_Comm group) {
  double sums[2] = {0, 0};
  for (size_t i = 0; i < x.size(); ++i) {
    sums[0] += (x[i] - reference[i]) * (x[i] - reference[i]);
    sums[1] += reference[i] * reference[i];
  }
  MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, group);
  if (sums[1] == 0) return std::sqrt(sums[0]);
  return std::sqrt(sums[0] / sums[1]);
}

double group_max(double v, MPI_Comm group) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, group);
  return v;
}

OwnedContext Harness::own_context() const {
  shardmuon_context_t context = nullptr;
  if (shardmuon_context_create(backend_, device_, &context) != SHARDMUON_SUCCESS) {
    context = nullptr;
  }
  return OwnedContext(context, shardmuon_context_destroy);
}

bool group_all(bool v, MPI_Comm group) {
  int value = v ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT, MPI_MIN, group);
  return value == 1;
}

}  // namespace shardmuon_test
