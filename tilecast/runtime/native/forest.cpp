// Raw scores of a LightGBM forest of numerical trees, flattened by tilecast/native/forest.py.
//
// The rows of one dispatch query share many features (the problem's, the hardware's), so
// each tree is walked once for all rows together: a node carries the set of rows that reach
// it (a bitset), splits it by its decision (one AVX-512 compare covers 8 rows) and hands each
// half to its child; an empty half prunes the whole subtree, and a split on a column that
// holds one value for every row costs one decision. A leaf adds its value to every row of
// its set. Each row meets exactly one leaf per tree and the trees are visited in order, so
// every score is summed tree by tree from 0.0, as LightGBM sums it: the scores equal
// Booster.predict(raw_score=True) bit for bit.
//
// The decisions are LightGBM's (tree.h NumericalDecision) on the values LightGBM's dense
// predictor sees: |x| <= kZeroThreshold reads as 0 (the predictor keeps only larger values),
// NaN reads as 0 unless the node's missing type is NaN, and a missing value (0 for missing
// type Zero, NaN for missing type NaN) follows the node's default direction.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" {

// One node, kept in step with NODE_DTYPE in forest.py.
struct TcNode {
  double value;     // split threshold, or the output of a leaf
  int32_t feature;  // column | (mode << kModeShift)
  int16_t left;     // tree-relative node index
  int16_t right;
};

// The flattened forest, kept in step with ForestView in forest.py.
struct TcForest {
  const TcNode* nodes;
  const int32_t* tree_offsets;  // first node of each tree
  int32_t n_trees;
  int32_t max_depth;            // levels from a root to its deepest leaf, over all trees
  int32_t general;              // 1 when some node has missing type Zero or NaN
  int32_t portable;             // 1: scalar code even where AVX-512 exists (for tests)
  const int32_t* used_columns;  // every column some node reads, once
  int32_t n_used;
  int32_t max_column;           // the largest of them
};

}  // extern "C"

namespace {

static_assert(sizeof(TcNode) == 16, "TcNode must stay 16 bytes");

// LightGBM's kZeroThreshold is the float 1e-35f widened to double.
constexpr double kZeroThreshold = static_cast<double>(1e-35f);
constexpr int kModeShift = 24;
constexpr int32_t kColumnMask = (1 << kModeShift) - 1;
// node modes, kept in step with MISSING_MODES and LEAF_MODE in forest.py
enum Mode : int32_t {
  kPlain = 0, kZeroRight = 1, kZeroLeft = 2, kNanRight = 3, kNanLeft = 4, kLeaf = 7
};

inline bool default_left(int32_t mode) { return mode == kZeroLeft || mode == kNanLeft; }

// One row's decision, the reference the vector code follows. Without `general` NaN has been
// read as 0 already (no node gives NaN a meaning of its own).
template <bool general>
inline bool goes_left(double raw, double threshold, int32_t mode) {
  if (!general) return raw <= threshold;
  const bool is_nan = std::isnan(raw);
  const double value = is_nan ? 0.0 : raw;
  const bool missing = ((mode == kZeroRight || mode == kZeroLeft) && value == 0.0) ||
                       ((mode == kNanRight || mode == kNanLeft) && is_nan);
  return missing ? default_left(mode) : value <= threshold;
}

// The rows of `rows` (bits for column[0..63]) that go left, and adding a leaf's value to the
// rows of `rows` (bits for out[0..63]): one row at a time, and 8 rows per instruction.
template <bool general>
inline uint64_t left_rows_scalar(const double* column, uint64_t rows, double threshold,
                                 int32_t mode) {
  uint64_t left = 0;
  for (uint64_t rest = rows; rest; rest &= rest - 1) {
    const int bit = __builtin_ctzll(rest);
    if (goes_left<general>(column[bit], threshold, mode)) left |= uint64_t{1} << bit;
  }
  return left;
}

inline void add_leaf_scalar(double* out, uint64_t rows, double value) {
  for (; rows; rows &= rows - 1) out[__builtin_ctzll(rows)] += value;
}

#if defined(__AVX512F__)
template <bool general>
inline uint64_t left_rows_avx512(const double* column, uint64_t rows, double threshold,
                                 int32_t mode) {
  const __m512d limit = _mm512_set1_pd(threshold);
  const __m512d zero = _mm512_setzero_pd();
  uint64_t left = 0;
  for (int lane = 0; lane < 64; lane += 8) {
    const __mmask8 active = static_cast<__mmask8>(rows >> lane);
    if (!active) continue;
    // masked loads read only the rows in the set: the column needs no padding
    const __m512d raw = _mm512_maskz_loadu_pd(active, column + lane);
    __mmask8 go_left;
    if (!general) {
      go_left = _mm512_mask_cmp_pd_mask(active, raw, limit, _CMP_LE_OQ);
    } else {
      const __mmask8 is_nan = _mm512_cmp_pd_mask(raw, raw, _CMP_UNORD_Q);
      const __m512d value = _mm512_mask_blend_pd(is_nan, raw, zero);
      const __mmask8 below = _mm512_cmp_pd_mask(value, limit, _CMP_LE_OQ);
      __mmask8 missing = 0;
      if (mode == kZeroRight || mode == kZeroLeft)
        missing = _mm512_cmp_pd_mask(value, zero, _CMP_EQ_OQ);
      else if (mode == kNanRight || mode == kNanLeft)
        missing = is_nan;
      const __mmask8 defaults = default_left(mode) ? missing : 0;
      go_left = active & ((missing & defaults) | (~missing & below));
    }
    left |= static_cast<uint64_t>(go_left) << lane;
  }
  return left;
}

inline void add_leaf_avx512(double* out, uint64_t rows, double value) {
  const __m512d add = _mm512_set1_pd(value);
  for (int lane = 0; lane < 64; lane += 8) {
    const __mmask8 active = static_cast<__mmask8>(rows >> lane);
    if (!active) continue;
    const __m512d sum = _mm512_maskz_loadu_pd(active, out + lane);
    _mm512_mask_storeu_pd(out + lane, active, _mm512_add_pd(sum, add));
  }
}
#endif

template <bool general, bool vector>
inline uint64_t left_rows(const double* column, uint64_t rows, double threshold, int32_t mode) {
#if defined(__AVX512F__)
  if (vector) return left_rows_avx512<general>(column, rows, threshold, mode);
#endif
  return left_rows_scalar<general>(column, rows, threshold, mode);
}

template <bool vector>
inline void add_leaf(double* out, uint64_t rows, double value) {
#if defined(__AVX512F__)
  if (vector) return add_leaf_avx512(out, rows, value);
#endif
  add_leaf_scalar(out, rows, value);
}

// Whether LightGBM's predictor reads x as another value: |x| <= kZeroThreshold (not 0) reads
// as 0; NaN reads as 0 unless the forest has NaN or Zero missing types, whose nodes decide.
inline bool reads_differently(double x, bool general) {
  if (std::isnan(x)) return !general;
  return x != 0.0 && std::fabs(x) <= kZeroThreshold;
}

// One pass over a column: whether every row holds the same value (==, so 0.0 and -0.0 count
// as one; they decide alike), and whether some value may read differently (NaN, or tiny).
inline void scan_column(const double* column, int64_t n_rows, bool* same, bool* odd) {
  const double first = column[0];
  int64_t r = 0;
  bool all_same = true, any_odd = false;
#if defined(__AVX512F__)
  const __m512d first_v = _mm512_set1_pd(first);
  const __m512d tiny = _mm512_set1_pd(kZeroThreshold);
  const __m512d zero = _mm512_setzero_pd();
  __mmask8 unequal = 0, odd_lanes = 0;
  for (; r + 8 <= n_rows; r += 8) {
    const __m512d x = _mm512_loadu_pd(column + r);
    unequal |= _mm512_cmp_pd_mask(x, first_v, _CMP_NEQ_UQ);
    // not |x| > tiny (so NaN too), and x != 0
    odd_lanes |= _mm512_mask_cmp_pd_mask(
        _mm512_cmp_pd_mask(_mm512_abs_pd(x), tiny, _CMP_NGT_UQ), x, zero, _CMP_NEQ_UQ);
  }
  all_same = unequal == 0;
  any_odd = odd_lanes != 0;
#endif
  for (; r < n_rows; ++r) {
    const double x = column[r];
    all_same = all_same && x == first;
    any_odd = any_odd || std::isnan(x) || (x != 0.0 && std::fabs(x) <= kZeroThreshold);
  }
  *same = all_same;
  *odd = any_odd;
}

// Every tree in order, depth first, each node splitting the set of rows that reaches it.
template <bool general, bool vector>
void walk(const TcForest& forest, const double* columns, int64_t n_rows, int64_t stride,
          const uint8_t* uniform, double* out) {
  const int64_t words = (n_rows + 63) / 64;
  // a stack of (node, row set): a split replaces its entry by the left half and pushes the
  // right half, so it never holds more than max_depth + 1 entries
  const size_t entries = static_cast<size_t>(forest.max_depth) + 2;
  thread_local std::vector<int32_t> stack_nodes;
  thread_local std::vector<uint64_t> stack_rows;
  thread_local std::vector<uint64_t> all_rows;
  stack_nodes.resize(entries);
  stack_rows.resize(entries * static_cast<size_t>(words));
  all_rows.assign(static_cast<size_t>(words), ~uint64_t{0});
  if (n_rows % 64) all_rows[words - 1] = (uint64_t{1} << (n_rows % 64)) - 1;

  for (int32_t t = 0; t < forest.n_trees; ++t) {
    const TcNode* tree = forest.nodes + forest.tree_offsets[t];
    int64_t top = 0;
    stack_nodes[0] = 0;
    std::memcpy(stack_rows.data(), all_rows.data(), sizeof(uint64_t) * words);
    while (top >= 0) {
      const TcNode node = tree[stack_nodes[top]];
      uint64_t* left = stack_rows.data() + top * words;
      const int32_t mode = node.feature >> kModeShift;
      if (mode == kLeaf) {
        for (int64_t w = 0; w < words; ++w)
          if (left[w]) add_leaf<vector>(out + w * 64, left[w], node.value);
        --top;
        continue;
      }
      const int64_t column_index = node.feature & kColumnMask;
      const double* column = columns + column_index * stride;
      if (uniform[column_index]) {
        stack_nodes[top] =
            goes_left<general>(column[0], node.value, mode) ? node.left : node.right;
        continue;
      }
      uint64_t* right = left + words;
      bool any_left = false, any_right = false;
      for (int64_t w = 0; w < words; ++w) {
        const uint64_t here = left[w];
        const uint64_t goes =
            here ? left_rows<general, vector>(column + w * 64, here, node.value, mode) : 0;
        left[w] = here & goes;
        right[w] = here & ~goes;
        any_left |= left[w] != 0;
        any_right |= right[w] != 0;
      }
      if (any_left && any_right) {
        stack_nodes[top] = node.left;
        stack_nodes[++top] = node.right;
      } else if (any_left) {
        stack_nodes[top] = node.left;
      } else {
        stack_nodes[top] = node.right;
        std::memcpy(left, right, sizeof(uint64_t) * words);
      }
    }
  }
}

}  // namespace

extern "C" {

// Raw scores into out[n_rows] of n_rows rows whose features are stored column by column:
// feature c of row r is columns[c * stride + r]. Returns 0, or -1 when a node reads a
// column >= n_cols or stride < n_rows.
int tc_forest_predict(const TcForest* forest, const double* columns, int64_t n_rows,
                      int64_t n_cols, int64_t stride, double* out) {
  if (forest->max_column >= n_cols || stride < n_rows) return -1;
  if (n_rows <= 0) return 0;
  std::memset(out, 0, sizeof(double) * static_cast<size_t>(n_rows));
  const bool general = forest->general != 0;
  thread_local std::vector<uint8_t> uniform;
  uniform.assign(static_cast<size_t>(n_cols), 0);
  bool any_odd = false;
  for (int32_t i = 0; i < forest->n_used; ++i) {
    const int64_t c = forest->used_columns[i];
    bool same, odd;
    scan_column(columns + c * stride, n_rows, &same, &odd);
    uniform[c] = same;
    any_odd |= odd;
  }
  // Values that read differently are rare (the scan also reports NaN, which a general forest
  // keeps): copy the columns, as the predictor reads them, only when there is one.
  bool any_different = false;
  for (int32_t i = 0; any_odd && i < forest->n_used; ++i) {
    const double* column = columns + forest->used_columns[i] * stride;
    for (int64_t r = 0; r < n_rows; ++r) any_different |= reads_differently(column[r], general);
  }
  thread_local std::vector<double> copy;
  if (any_different) {
    copy.resize(static_cast<size_t>(n_cols * n_rows));
    for (int64_t c = 0; c < n_cols; ++c)
      for (int64_t r = 0; r < n_rows; ++r) {
        const double x = columns[c * stride + r];
        copy[c * n_rows + r] = reads_differently(x, general) ? 0.0 : x;
      }
    columns = copy.data();
    stride = n_rows;
  }

  bool vector = false;
#if defined(__AVX512F__)
  vector = forest->portable == 0;
#endif
  const uint8_t* same = uniform.data();
  if (general) {
    if (vector) walk<true, true>(*forest, columns, n_rows, stride, same, out);
    else walk<true, false>(*forest, columns, n_rows, stride, same, out);
  } else {
    if (vector) walk<false, true>(*forest, columns, n_rows, stride, same, out);
    else walk<false, false>(*forest, columns, n_rows, stride, same, out);
  }
  return 0;
}

}  // extern "C"
