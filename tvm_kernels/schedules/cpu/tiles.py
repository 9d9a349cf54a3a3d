"""Register tiles and loop choices per x86 vector ISA: the one place where the AVX2 and AVX-512
builds of the CPU kernels differ. The kernels ask :func:`tiles_for` with their target's ISA name
(``isa`` in tvm_kernels/variants.py) and test no ISA themselves; a new vector ISA is a new entry
here plus the kernels that use it (AVX512-BF16's: bf16_dot.py). AMX has no entry: its fused
kernels are AVX512-BF16's with their tile products on AMX (schedules/cpu_amx). The measurements
behind each choice are in bench/NOTES.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm_kernels.compute import accumulation_dtype


@dataclass(frozen=True)
class Tiles:
    vector_bits: int  # SIMD register width
    # Q.K^T (also inside the fused kernels): rows x vectors of accumulators.
    qk_rows: int
    qk_vectors: int
    # probs.V and transposed (also the fused kernels' context and dQ): rows x 2 vectors.
    band_rows: int
    # Half types, probs.V and transposed, head_dim a multiple of 4 vectors: 4 rows x 4 vectors.
    wide_half_tile: bool
    # probs.V and transposed, direct path: steps per chunk, every feature tile of a chunk before
    # the next (0: the whole band in one chunk).
    chunk_steps: int
    # Half types, same path: a chunk's weights converted once into a buffer (else at each use).
    stage_half_weights: bool
    # The fused backward's dK/dV update: rows x 2 vectors.
    key_update_rows: int
    # The fused backward's queries per tile (a multiple of qk_rows and band_rows): the dK/dV
    # update's accumulators are loaded and stored once per tile.
    backward_tile_rows: int
    # bfloat16 band products (Q.K^T, probs.V, transposed) and fused attention through the CPU's
    # bfloat16 dot product (bf16_dot.py) instead of FMAs.
    bf16_dot: bool = False
    # bfloat16's elementwise kernels (GELU, dropout, layer norm, global merge) on 32-bit pairs of
    # values, where widening and rounding one value at a time cost more than the arithmetic; the GELU
    # forward in two passes per run of vectors (computed, then rounded), where the register file
    # cannot hold the GELU's constants and the rounding's at once (schedules/cpu/gelu.py).
    bfloat16_pairs: bool = False

    def pairs_for(self, dtype: str) -> bool:
        """Whether ``dtype``'s elementwise kernels take their values as 32-bit pairs (bfloat16 where set)."""
        return self.bfloat16_pairs and dtype == "bfloat16"

    def dot_product_for(self, dtype: str) -> bool:
        """Whether ``dtype``'s kernels run on the bfloat16 dot product (bfloat16 where the ISA has it)."""
        return self.bf16_dot and dtype == "bfloat16"


# AVX-512 (32 zmm registers). Q.K^T 16 x 1: the tile then advances by exactly one key block, so
# every tile's band starts on a block boundary (528 columns computed per 513; 12 x 2: ~557).
# probs.V / transposed 8 x 2 (12 rows: no faster for probs.V, 1.5x slower for transposed); half
# types 4 x 4, because a half weight costs a broadcast and a convert per use (float32's broadcast
# rides in the FMA) and that tile uses each weight for 4 FMAs instead of 2.
AVX512 = Tiles(
    vector_bits=512,
    qk_rows=16,
    qk_vectors=1,
    band_rows=8,
    wide_half_tile=True,
    chunk_steps=0,
    stage_half_weights=False,
    key_update_rows=8,
    backward_tile_rows=16,
)

# AVX2 (16 ymm registers, 32 KiB L1 on the EPYCs measured): 6 x 2 accumulators + 1 load + 1
# broadcast fill the register file. The direct probs.V / transposed loop runs in chunks of 32
# steps so that the band lines a chunk reads are read again from L1 by its other feature tiles
# (transposed reads a new band row every step), and half types convert a chunk's weights once:
# no room for a wider tile. The fused backward runs tiles of 12 queries (two Q.K^T register tiles):
# its dK/dV update then loads and stores its 4 x 2 accumulators once per 96 FMAs instead of 48
# (backward 3-6% faster at n = 4096; AVX-512's float32 keeps 16: 32 was 1-4% slower).
AVX2 = Tiles(
    vector_bits=256,
    qk_rows=6,
    qk_vectors=2,
    band_rows=6,
    wide_half_tile=False,
    chunk_steps=32,
    stage_half_weights=True,
    key_update_rows=4,
    backward_tile_rows=12,
    bfloat16_pairs=True,
)


# AVX-512 with AVX512-BF16 (AMD Zen 4 and later, Intel since Cooper Lake): AVX-512's tiles, and the
# bfloat16 band products and fused attention with vdpbf16ps (two products per lane and instruction;
# bench/NOTES.md). The fused backward's tiles hold 32 queries, where its dK/dV update (which takes
# them in pairs) loads and stores each accumulator once per 16 dot products, as float32's does per 16
# FMAs with 16 rows: forward+backward ~2% faster at n = 4096 on the Zen 4 (bench/NOTES.md).
AVX512_BF16 = replace(AVX512, bf16_dot=True, backward_tile_rows=32)

ISAS = {"avx2": AVX2, "avx512": AVX512, "avx512-bf16": AVX512_BF16}


def tiles_for(isa: str) -> Tiles:
    if isa not in ISAS:
        raise ValueError(f"no CPU tiles for isa {isa!r}; known: {sorted(ISAS)}")
    return ISAS[isa]


def accumulation_lanes(dtype: str, isa: str) -> int:
    """Lanes of one vector of ``dtype``'s accumulation dtype: the elementwise kernels' vector
    (dropout, GELU, the global merge, the layer norm compute in it)."""
    return tiles_for(isa).vector_bits // (64 if accumulation_dtype(dtype) == "float64" else 32)
