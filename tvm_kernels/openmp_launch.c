/* Runs the CPU kernels' parallel loops on torch's OpenMP threads instead of TVM's own pool.
 *
 * A kernel library calls its parallel loops through the function pointer
 * __TVMBackendParallelLaunch, which TVM's runtime points at its own thread pool when the
 * library loads. Two pools on the same cores contend: right after a torch op, torch's
 * OpenMP workers keep spinning for milliseconds while TVM's workers start, and a 20 ms
 * kernel took 27 ms. The loader (longformer_ops/runtime/loader.py) points that slot here instead,
 * so kernels run on the very threads torch just used. This library links libgomp.so.1, which
 * resolves to the copy torch already loaded.
 *
 * The contract (TVM's include/tvm/runtime/c_backend_api.h): call body(task_id, env, closure)
 * for task_id = 0 .. env->num_task - 1, each on its own thread; num_task = 0 means "as many
 * as you have". Our kernels never call the barrier, so sync_handle stays NULL. A task fails only
 * if its scratch allocation does; the kernel call then fails, but the message that task set
 * stays with its thread (TVM's own pool carries it over).
 */
#include <omp.h>

typedef struct {
  void* sync_handle;
  int num_task;
} parallel_group_env;

typedef int (*parallel_body)(int task_id, parallel_group_env* env, void* closure);

int longformer_parallel_launch(parallel_body body, void* closure, int num_task) {
  int failed = 0;
  int threads = num_task > 0 ? num_task : omp_get_max_threads();
#pragma omp parallel num_threads(threads) reduction(|| : failed)
  {
    /* The team may be smaller than asked (nested in another parallel region): the body
     * splits the loop by env.num_task, so it must be the team's real size. */
    parallel_group_env env = {0, omp_get_num_threads()};
    failed = body(omp_get_thread_num(), &env, closure) != 0;
  }
  return failed ? -1 : 0;
}
