// The "gvec" pipeline: a direct convolution, all three directions, whose vectors hold whole
// groups when they have few channels (ResNeXt's 4-16, RegNet's 8-16) and a group's channels
// otherwise (stems of 1-3 input channels and the like). bwd_weight reads the input and dout
// as forward reads the input and writes dout (D = K, S = C; see run_weight_grad).
//
// Per group, a layer of D destination channels (forward K, bwd_data C) and S source channels
// (forward C, bwd_data K) is a GEMM with D columns: a 16-lane vector would hold 4 of them at
// D = 4 and the per-group GEMM wastes the rest, which is why the gemm and direct pipelines
// run such layers at a small share of the machine. When D divides 16, one 16-lane row (a zmm, or two
// ymm) holds Gv = 16 / D whole groups, lanes in channel-major order (lane = d * Gv + gi), so
//
//   dst[m, gi, d] += src[source(m, t), gi, s] * w[gi, d, t, s]
//
// needs, for each (tap, source channel), one weight row and, per pixel, the Gv source values
// of its groups repeated D times: a broadcast of Gv consecutive floats (a 128-bit broadcast at
// Gv = 4), once the source is laid out [pixel][group block][s][gi]. Otherwise (Gv = 1) a pixel
// has NV = ceil(D / 16) rows (up to kMaxNV, more in further column blocks) of one group's
// channels, the last masked, and each broadcast source value feeds all NV rows.
//
// The source layout is a copy taken each call, into a zero-padded image where a destination
// pixel's source under each tap is its pixel's offset plus the tap's. bwd_data at a stride
// goes in phases of destination pixels that share their taps (GroupVectorConv::Phase), so no
// tap it runs reads between dout's pixels. Weights are packed each call to [column
// block][tap][s][lane]; with Gv > 1 lanes go back to [gi][d] order when the tile is stored.
//
// Tile: MR destination pixels x NV 16-lane rows, reduced over (tap, source channel), source
// channels SB at a time with their weight rows in registers. Blocks: BM pixels x BN / (16 NV)
// column blocks, BK taps per pass. Waves as in the dw pipeline: intra splits each block's
// pixel blocks among the threads, inter deals out whole (column block, image) units.
//
// In place (in_place_block): depthwise (16 groups a row) reads the source where it lies
// (bwd_data at a stride a phase at a time, din's lines in order so the dout rows they read
// stay in cache), and on AVX2 builds one group's channels a row (Gv = 1,
// one phase) reads a copy padded only along w. A destination line runs only the taps whose
// (d, h) source row is inside the image, its pixels in tiles along w (6-7 on AVX2, 14 on
// AVX-512), each tile one row of 16 lanes: a depthwise source vector, or a broadcast of one
// source channel, against the tap's weight row. No relayout, no tap over a padding row, no
// per-pixel pointers (on AVX2, several times faster than the tiles above on depthwise
// layers, stems and dense 3x3 layers of few channels).
#pragma once

#include "grouped_conv_gvec_conv.hpp"
#include "grouped_conv_gvec_gather.hpp"
#include "grouped_conv_gvec_in_place.hpp"
#include "grouped_conv_gvec_layout.hpp"
#include "grouped_conv_gvec_weight_grad.hpp"
