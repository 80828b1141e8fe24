/* Export macro of the ddprun worker library (libddprun_worker.so): everything else is hidden. */
#ifndef DDPRUN_WORKER_EXPORT_H
#define DDPRUN_WORKER_EXPORT_H
#if defined(_WIN32)
#define DDPRUN_WORKER_API
#else
#define DDPRUN_WORKER_API __attribute__((visibility("default")))
#endif
#endif
