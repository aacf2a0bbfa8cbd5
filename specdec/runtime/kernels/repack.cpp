// GGUF Q4_K and Q6_K blocks -> the q4k and q6k kernels' tile layouts, in one pass over the file.
//
// The load-time repack of a 7-8B file: each output byte is a fixed function of a few input bytes
// (no arithmetic on the weights at all), so this is a byte shuffle at memory speed. The torch
// functions it replaces (specdec.runtime.q4.pack_q4k_grid over gguf_q4k.decode_blocks, and
// specdec.runtime.q6k.pack over q6k.decode_blocks) stay as the reference: the tests compare the
// two byte for byte.
//
// Both functions take the file's rows of blocks `src` [R, row bytes] (a view of the memory map),
// the file rows to take in order `rows` [n] (the q/k rows of a llama file are permuted), and write
// tiles `tile0 .. tile0 + ceil(n / 16)` of `out` [tiles, tile bytes]; rows past n are zero.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t TILE = 16;

// ---- Q4_K: 144-byte blocks of 256 weights: d, dmin (fp16), 12 bytes of 6-bit sc/m, 128 of codes.
// A tile's superblock (2,368 bytes): codes [8 groups][256] (byte 64r + 4o + t: input 4r + t of
// output o, low nibble, and input 16 + 4r + t, high nibble), sc [8][16], m as pairs [4][16][2],
// d [16] and dmin [16] fp16.
constexpr int64_t Q4K_BLOCK = 144, Q4K_SB = 8 * 256 + 8 * 16 + 8 * 16 + 32 + 32;

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

constexpr uint32_t NIBBLES = 0x0F0F0F0Fu, PAIRS = 0x03030303u;  // per byte of a 32-bit word

inline void q4k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 0x3F;
    *m = s[j + 4] & 0x3F;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void q4k_tile_superblock(const uint8_t* const* blocks, uint8_t* dst) {
  // blocks[o]: output o's block of this superblock, or nullptr (a padding row: all zero)
  uint8_t* codes = dst;
  uint8_t* sc = dst + 8 * 256;
  uint8_t* mp = sc + 8 * 16;
  uint8_t* d = mp + 8 * 16;
  uint8_t* dmin = d + 32;
  for (int o = 0; o < TILE; ++o) {
    const uint8_t* b = blocks[o];
    if (!b) continue;
    std::memcpy(d + 2 * o, b, 2);
    std::memcpy(dmin + 2 * o, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      uint8_t s, m;
      q4k_scale_min(b + 4, j, &s, &m);
      sc[j * 16 + o] = s;
      mp[(j / 2) * 32 + o * 2 + (j % 2)] = m;
      // group j: chunk j / 2 of 32 code bytes, low nibbles for even j, high for odd; four bytes
      // (t = 0..3) at a time: inputs 4r + t (low nibble) and 16 + 4r + t (high nibble)
      const uint8_t* q = b + 16 + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      uint8_t* g = codes + j * 256 + 4 * o;
      for (int r = 0; r < 4; ++r) {
        const uint32_t lo = (load32(q + 4 * r) >> shift) & NIBBLES, hi = (load32(q + 16 + 4 * r) >> shift) & NIBBLES;
        store32(g + 64 * r, lo | (hi << 4));
      }
    }
  }
}

// ---- Q6_K: 210-byte blocks: ql [128], qh [64], sc [16] int8, d fp16. A tile's superblock (3,360
// bytes): per group of 16 inputs, 128 bytes of low nibbles (byte 64p + 4o + t: inputs 4(2p) + t
// low, 4(2p + 1) + t high) and 64 bytes of top bit pairs (byte 4o + t: input 4r + t at bits 2r);
// then sc [16 groups][16] and d [16] fp16.
constexpr int64_t Q6K_BLOCK = 210, Q6K_GROUP_BYTES = 192, Q6K_SB = 16 * Q6K_GROUP_BYTES + 256 + 32;

inline void q6k_codes(const uint8_t* b, uint32_t* u) {
  // the block's 256 6-bit codes, four a word: weight i = 128h + 32q + l has its low nibble in
  // ql[64h + i % 64] (low half for q < 2, high for q >= 2) and its top pair in bits 2q of qh[32h + l]
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 4; ++q)
      for (int l = 0; l < 32; l += 4) {
        const uint32_t low = (load32(b + 64 * h + 32 * (q % 2) + l) >> (4 * (q / 2))) & NIBBLES;
        const uint32_t top = (load32(b + 128 + 32 * h + l) >> (2 * q)) & PAIRS;
        u[(128 * h + 32 * q + l) / 4] = low | (top << 4);
      }
}

void q6k_tile_superblock(const uint8_t* const* blocks, uint8_t* dst) {
  uint8_t* sc = dst + 16 * Q6K_GROUP_BYTES;
  uint8_t* d = sc + 256;
  for (int o = 0; o < TILE; ++o) {
    const uint8_t* b = blocks[o];
    if (!b) continue;
    std::memcpy(d + 2 * o, b + 208, 2);
    uint32_t u[64];
    q6k_codes(b, u);
    for (int g = 0; g < 16; ++g) {
      sc[g * 16 + o] = b[192 + g];
      uint8_t* low = dst + g * Q6K_GROUP_BYTES + 4 * o;
      const uint32_t* c = u + 4 * g;  // c[r]: inputs 4r .. 4r + 3 of the group
      store32(low, (c[0] & NIBBLES) | ((c[1] & NIBBLES) << 4));
      store32(low + 64, (c[2] & NIBBLES) | ((c[3] & NIBBLES) << 4));
      uint32_t top = 0;
      for (int r = 0; r < 4; ++r) top |= ((c[r] >> 4) & PAIRS) << (2 * r);
      store32(low + 128, top);
    }
  }
}

using TileFn = void (*)(const uint8_t* const*, uint8_t*);

void repack(torch::Tensor src, torch::Tensor rows, torch::Tensor out, int64_t tile0, int64_t block_bytes,
            int64_t sb_bytes, TileFn fn) {
  TORCH_CHECK(src.dtype() == torch::kUInt8 && src.dim() == 2 && src.is_contiguous(), "src: contiguous uint8 [R, row bytes]");
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.dim() == 2 && out.is_contiguous(), "out: contiguous uint8 [tiles, bytes]");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1, "rows: int64 [n]");
  const int64_t n = rows.size(0), R = src.size(0), row_bytes = src.size(1);
  TORCH_CHECK(row_bytes % block_bytes == 0, "src rows are not whole blocks");
  const int64_t S = row_bytes / block_bytes, tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(out.size(1) == S * sb_bytes, "out's tiles do not match src's blocks");
  TORCH_CHECK(tile0 >= 0 && tile0 + tiles <= out.size(0), "out has too few tiles");
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < R, "row index out of range");
  const uint8_t* base = src.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>() + tile0 * out.size(1);
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = dst + t * S * sb_bytes;
      std::memset(tile, 0, S * sb_bytes);
      const uint8_t* row[TILE];
      for (int o = 0; o < TILE; ++o) {
        const int64_t i = t * TILE + o;
        row[o] = i < n ? base + ids[i] * row_bytes : nullptr;
      }
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* blocks[TILE];
        for (int o = 0; o < TILE; ++o) blocks[o] = row[o] ? row[o] + s * block_bytes : nullptr;
        fn(blocks, tile + s * sb_bytes);
      }
    }
  });
}

}  // namespace

void q4k_repack(torch::Tensor src, torch::Tensor rows, torch::Tensor out, int64_t tile0) {
  repack(src, rows, out, tile0, Q4K_BLOCK, Q4K_SB, q4k_tile_superblock);
}

void q6k_repack(torch::Tensor src, torch::Tensor rows, torch::Tensor out, int64_t tile0) {
  repack(src, rows, out, tile0, Q6K_BLOCK, Q6K_SB, q6k_tile_superblock);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4k_repack", &q4k_repack, "GGUF Q4_K rows -> q4k kernel tiles");
  m.def("q6k_repack", &q6k_repack, "GGUF Q6_K rows -> q6k kernel tiles");
}
