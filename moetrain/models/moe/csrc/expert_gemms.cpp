// Expert GEMMs on a multi-core CPU with whole experts per thread.
//
// torch._grouped_mm (and a Python loop of torch.mm) runs the experts one after another and lets
// the BLAS split each expert's GEMM over all threads. For expert-sized GEMMs (~1000 rows) that
// split costs: every thread packs the whole weight matrix for half the rows, and the threads
// synchronise at the end of every GEMM. Measured on 2 cores (MKL): a [1024 x 512] x [512 x 1024]
// GEMM per expert runs ~5% below one [8192 x 512] x [512 x 1024] GEMM at 2 threads and at the
// dense rate at 1 thread. So here each thread multiplies whole experts: the experts are dealt
// into one bin per thread (largest first, onto the least-loaded bin), at::parallel_for runs one
// bin per thread, and the BLAS, called inside a parallel region, runs single-threaded. An expert
// too large to share out (more than a thread's fair share of the rows) runs first on its own
// with the BLAS's threads, and so does everything when the bins come out uneven: a collapsed
// router must not leave a core idle.
//
// Shape legend: M rows (token copies grouped by expert), I input dim, O output dim, E experts.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

struct Plan {
  std::vector<int64_t> start;                // first row of each expert
  std::vector<int64_t> alone;                // experts run one by one with all threads
  std::vector<std::vector<int64_t>> bins;    // experts of each thread
};

// How much more than an even share of the rows the heaviest bin may hold: beyond it the idle
// threads would cost more than the BLAS's own split of every GEMM (~5%).
constexpr double kMaxImbalance = 1.05;

Plan make_plan(const std::vector<int64_t>& sizes, int64_t num_threads) {
  const int64_t E = static_cast<int64_t>(sizes.size());
  Plan plan;
  plan.start.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(sizes[e] >= 0, "expert ", e, " has a negative row count ", sizes[e]);
    plan.start[e + 1] = plan.start[e] + sizes[e];
  }
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sizes[a] > sizes[b]; });
  int64_t rest = plan.start[E];
  size_t first = 0;
  // Largest first: an expert with more than a thread's share of what is left runs alone.
  while (first < order.size() && sizes[order[first]] * num_threads > rest) {
    plan.alone.push_back(order[first]);
    rest -= sizes[order[first]];
    ++first;
  }
  plan.bins.assign(num_threads, {});
  std::vector<int64_t> load(num_threads, 0);
  for (size_t i = first; i < order.size(); ++i) {
    const int64_t e = order[i];
    if (sizes[e] == 0) {
      plan.bins[0].push_back(e);  // nothing to multiply; a weight gradient still needs zeros
      continue;
    }
    const auto bin = std::min_element(load.begin(), load.end()) - load.begin();
    plan.bins[bin].push_back(e);
    load[bin] += sizes[e];
  }
  const int64_t heaviest = *std::max_element(load.begin(), load.end());
  if (rest > 0 && heaviest * num_threads > kMaxImbalance * rest) {
    for (auto& bin : plan.bins) {
      plan.alone.insert(plan.alone.end(), bin.begin(), bin.end());
      bin.clear();
    }
  }
  return plan;
}

// Calls fn(e) for every expert as the plan says.
template <typename Fn>
void for_each_expert(const Plan& plan, Fn fn) {
  // Plain products (the autograd Function around them does the bookkeeping). Grad mode is
  // thread-local, and on in the pool's threads whatever the caller's is.
  at::NoGradGuard no_grad;
  for (int64_t e : plan.alone) {
    fn(e);
  }
  const int64_t num_bins = static_cast<int64_t>(plan.bins.size());
  at::parallel_for(0, num_bins, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad_here;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t e : plan.bins[b]) {
        fn(e);
      }
    }
  });
}

void check(const torch::Tensor& a, const torch::Tensor& b, int64_t rows, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(a.dim() == 2 && b.dim() >= 2, "expected a 2-D input and stacked matrices");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "the expert-per-thread GEMMs run on the CPU");
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TORCH_CHECK(total == rows, "the expert row counts add up to ", total, ", the input has ", rows, " rows");
}

}  // namespace

// out[rows of e] = x[rows of e] @ w[e]: x [M, I], w [E, I, O] (any strides), out [M, O].
torch::Tensor grouped_mm(const torch::Tensor& x_MI, const torch::Tensor& w_EIO, const std::vector<int64_t>& sizes) {
  check(x_MI, w_EIO, x_MI.size(0), sizes);
  TORCH_CHECK(w_EIO.dim() == 3 && w_EIO.size(0) == static_cast<int64_t>(sizes.size()) &&
                  w_EIO.size(1) == x_MI.size(1),
              "weights ", w_EIO.sizes(), " do not match the input ", x_MI.sizes(), " and ", sizes.size(), " experts");
  auto out_MO = torch::empty({x_MI.size(0), w_EIO.size(2)}, x_MI.options());
  const Plan plan = make_plan(sizes, at::get_num_threads());
  for_each_expert(plan, [&](int64_t e) {
    const int64_t rows = sizes[e];
    if (rows > 0) {
      auto out = out_MO.narrow(0, plan.start[e], rows);
      at::mm_out(out, x_MI.narrow(0, plan.start[e], rows), w_EIO.select(0, e));
    }
  });
  return out_MO;
}

// out[e] = x[rows of e]^T @ g[rows of e]: the gradient of w[e] in grouped_mm. x [M, I], g [M, O].
torch::Tensor grouped_mm_weight_grad(const torch::Tensor& x_MI, const torch::Tensor& grad_MO,
                                     const std::vector<int64_t>& sizes) {
  check(x_MI, grad_MO, x_MI.size(0), sizes);
  TORCH_CHECK(grad_MO.dim() == 2 && grad_MO.size(0) == x_MI.size(0), "input ", x_MI.sizes(),
              " and gradient ", grad_MO.sizes(), " differ in rows");
  const int64_t E = static_cast<int64_t>(sizes.size());
  auto out_EIO = torch::empty({E, x_MI.size(1), grad_MO.size(1)}, x_MI.options());
  const Plan plan = make_plan(sizes, at::get_num_threads());
  for_each_expert(plan, [&](int64_t e) {
    const int64_t rows = sizes[e];
    auto out = out_EIO.select(0, e);
    if (rows == 0) {
      out.zero_();
      return;
    }
    at::mm_out(out, x_MI.narrow(0, plan.start[e], rows).t(), grad_MO.narrow(0, plan.start[e], rows));
  });
  return out_EIO;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_mm", &grouped_mm, "x[rows of e] @ w[e] for every expert e, whole experts per thread");
  m.def("grouped_mm_weight_grad", &grouped_mm_weight_grad, "x[rows of e]^T @ g[rows of e] for every expert e");
}
