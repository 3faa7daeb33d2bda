"""The model-independent part of an exported selector's C source (c_source puts the tables
between PRELUDE and FUNCTIONS): LightGBM's decisions and the forest walk over candidate sets.

The forest is walked tree by tree for all candidates at once, as tilecast/runtime/native/
forest.cpp does: a node holds the set of candidates (a bitset) that reach it and splits it.
A split on a problem feature sends the whole set one way (one comparison for all); a split
on a kernel feature splits it with a mask computed at export; only a split on an interaction
feature compares per candidate. Each candidate meets one leaf per tree and trees are visited
in order, so every score is summed as LightGBM sums it.
"""

# includes, the floating-point guards, tc_ctz
PRELUDE = r"""#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__FAST_MATH__)
#error "compile without -ffast-math: the features must be IEEE float64 arithmetic"
#endif
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0
#error "the features need float64 arithmetic without excess precision (FLT_EVAL_METHOD 0)"
#endif
/* a fused multiply-add rounds once where numpy rounds twice */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#elif defined(_MSC_VER)
#pragma fp_contract(off)
#endif

#if defined(__GNUC__) || defined(__clang__)
#define tc_ctz(x) __builtin_ctzll(x)
#define tc_popcount(x) __builtin_popcountll(x)
#else
static int tc_ctz(uint64_t x) {
  int n = 0;
  while (!(x & 1)) { x >>= 1; ++n; }
  return n;
}
static int tc_popcount(uint64_t x) {
  int n = 0;
  for (; x; x &= x - 1) ++n;
  return n;
}
#endif"""

# tc_read, tc_goes_left, tc_forest: they read the TC_* macros and the tc_* tables
FUNCTIONS = r"""/* the value LightGBM's predictor reads */
static double tc_read(double value) {
  return fabs(value) <= TC_ZERO_THRESHOLD ? 0.0 : value;
}

/* NaN as a split without missing type NaN reads it: as the slot's zero */
static double tc_no_nan(double value, double zero) {
  return value != value ? zero : value;
}

/* LightGBM's NumericalDecision (tree.h) */
static int tc_goes_left(double value, double zero, const tc_node* node) {
  if (value != value) {
    if (node->missing == TC_MISSING_NAN) return node->default_left;
    value = zero;
  }
  if (node->missing == TC_MISSING_ZERO && value == zero) return node->default_left;
  return value <= node->threshold;
}

/* The candidates of `bits` whose value in `column` (lane b: candidate 64w + b) is at most
   `threshold`: a TC_PLAIN split, whose slot holds no NaN. A set of more than a few reads
   every lane of the word, branch-free (the lanes outside the set are zeros, then dropped). */
static uint64_t tc_plain_left(const double* column, uint64_t bits, double threshold) {
  uint64_t goes = 0;
  if (tc_popcount(bits) > 16) {
    int lane, bit;
    for (lane = 0; lane < 64; lane += 8) {
      unsigned byte = 0;
      for (bit = 0; bit < 8; ++bit) byte |= (unsigned)(column[lane + bit] <= threshold) << bit;
      goes |= (uint64_t)byte << lane;
    }
    return goes & bits;
  }
  for (; bits; bits &= bits - 1) {
    const int bit = tc_ctz(bits);
    goes |= (uint64_t)(column[bit] <= threshold) << bit;
  }
  return goes;
}

/* Raw scores of the candidates in `rows` added into `score`. */
static void tc_forest(const double* problem, const double* mixed, const uint64_t* rows,
                      double* score) {
  int32_t node_stack[TC_STACK];
  uint64_t row_stack[TC_STACK][TC_WORDS];
  int tree, w;
  for (tree = 0; tree < TC_TREES; ++tree) {
    int top = 0;
    node_stack[0] = tc_roots[tree];
    memcpy(row_stack[0], rows, sizeof row_stack[0]);
    while (top >= 0) {
      const int32_t at = node_stack[top];
      uint64_t* here = row_stack[top];
      if (at < 0) {
        const double value = tc_leaves[-1 - at];
        for (w = 0; w < TC_WORDS; ++w) {
          uint64_t bits = here[w];
          for (; bits; bits &= bits - 1) score[w * 64 + tc_ctz(bits)] += value;
        }
        --top;
        continue;
      }
      {
        const tc_node* node = &tc_nodes[at];
        uint64_t left[TC_WORDS];
        int any_left = 0, any_right = 0;
        if (node->kind == TC_PROBLEM) {
          const int go_left = tc_goes_left(problem[node->index],
                                           tc_problem_zero[node->index], node);
          node_stack[top] = go_left ? node->left : node->right;
          continue;
        }
        for (w = 0; w < TC_WORDS; ++w) {
          uint64_t goes = 0;
          if (node->kind == TC_KERNEL) {
            goes = here[w] & tc_kernel_masks[node->index][w];
          } else if (node->kind == TC_PLAIN) {
            goes = tc_plain_left(mixed + (size_t)node->index * TC_LANES + w * 64, here[w],
                                 node->threshold);
          } else {
            const double* column = mixed + (size_t)node->index * TC_LANES + w * 64;
            const double zero = tc_mixed_zero[node->index];
            uint64_t bits = here[w];
            for (; bits; bits &= bits - 1) {
              const int bit = tc_ctz(bits);
              goes |= (uint64_t)tc_goes_left(column[bit], zero, node) << bit;
            }
          }
          left[w] = goes;
          any_left |= goes != 0;
          any_right |= (here[w] & ~goes) != 0;
        }
        if (any_left && any_right) {
          for (w = 0; w < TC_WORDS; ++w) {
            row_stack[top + 1][w] = here[w] & ~left[w];
            here[w] = left[w];
          }
          node_stack[top] = node->left;
          node_stack[++top] = node->right;
        } else {
          node_stack[top] = any_left ? node->left : node->right;
        }
      }
    }
  }
}"""
