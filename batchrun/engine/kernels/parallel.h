// Runs fn(ctx, i) for i in [0, n), each i on its own thread.
//
// Built with OpenMP (the default), the kernels run on the same libgomp thread pool as PyTorch's
// own ops (torch's wheel ships libgomp.so.1 and the loader reuses it by soname), so no thread
// is created per call and the pool's waiting workers do not compete with ours. Without OpenMP
// it falls back to one pthread per task.
#pragma once
#include <pthread.h>

typedef void (*task_fn)(const void *ctx, int i);

#ifdef _OPENMP
#include <omp.h>
static inline void parallel_tasks(task_fn fn, const void *ctx, int n) {
    if (n <= 1) { if (n == 1) fn(ctx, 0); return; }
#pragma omp parallel for num_threads(n) schedule(static, 1)
    for (int i = 0; i < n; i++) fn(ctx, i);
}
#else
typedef struct { task_fn fn; const void *ctx; int i; } TaskArg;

static void *task_main(void *arg) {
    const TaskArg *t = (const TaskArg *)arg;
    t->fn(t->ctx, t->i);
    return NULL;
}

static inline void parallel_tasks(task_fn fn, const void *ctx, int n) {
    enum { MAX = 64 };
    TaskArg args[MAX];
    pthread_t tids[MAX];
    if (n > MAX) n = MAX;
    for (int i = 1; i < n; i++) {
        args[i] = (TaskArg){fn, ctx, i};
        pthread_create(&tids[i], NULL, task_main, &args[i]);
    }
    if (n >= 1) fn(ctx, 0);
    for (int i = 1; i < n; i++) pthread_join(tids[i], NULL);
}
#endif
