/* This CPU's float32 FMA peak, the ceiling under torch.mm and the band products.
 *
 *   cc -O2 -mavx512f -fopenmp bench/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *   (AVX2 only: cc -O2 -mavx2 -mfma -fopenmp ...)
 *
 * Each thread runs 12 independent FMA chains (more than latency x throughput on current
 * x86 cores), so the loop is bound by FMA throughput alone.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define STORE _mm512_storeu_ps
#else
typedef __m256 vec;
#define LANES 8
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#define STORE _mm256_storeu_ps
#endif

int main(void) {
    const long iterations = 100000000;
    double start = omp_get_wtime();
    float sink = 0;
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
        threads = omp_get_num_threads();
        vec acc[12], x = SET1(0.999f), y = SET1(0.001f);
        for (int i = 0; i < 12; i++) acc[i] = SET1((float)i);
        for (long it = 0; it < iterations; it++) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) acc[i] = FMA(acc[i], x, y);  /* unrolled: acc stays in registers */
        }
        float out[LANES];
        for (int i = 0; i < 12; i++) { STORE(out, acc[i]); sink += out[0]; }
    }
    double seconds = omp_get_wtime() - start;
    double gflops = 2.0 * LANES * 12 * iterations * threads / seconds / 1e9;
    printf("%d threads, %d-lane FMA: %.0f GFLOP/s float32 (%.0f per thread) [%g]\n",
           threads, LANES, gflops, gflops / threads, sink);
    return 0;
}
