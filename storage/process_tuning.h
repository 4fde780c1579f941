// Process-wide settings for programs that move block-sized buffers (kvdepotd
// and the benchmark tools). Call once at the top of main, before threads.
#ifndef KVDEPOT_STORAGE_PROCESS_TUNING_H_
#define KVDEPOT_STORAGE_PROCESS_TUNING_H_

namespace kvdepot {

// - Buffers of 128 KiB and more (blocks crossing gRPC, RocksDB values) stay
//   in the heap: by default glibc maps and unmaps each one, paying page
//   faults and TLB shootdowns on every request. Up to 512 MiB: a demoted
//   block of max_block_size (256 MiB) takes a RocksDB write batch and a
//   memtable entry of its size; with the limit at 64 MiB, blocks of 64 MiB
//   and more were mapped anew twice per demotion, and writing a DRAM tier
//   of 64 MiB blocks to NVMe on SIGTERM took 2x as long here (6.0 s vs
//   2.7-3.0 s for 768 MiB, alternating runs, 2-core VM). That holds on the
//   main arena (the thread that persists on SIGTERM); the other arenas'
//   heaps are at most 64 MiB, so a thread on one of them (the background
//   evictor) still maps each buffer of 64 MiB or more.
// - Few malloc arenas, so freed block-sized buffers are not kept once per
//   thread (RSS would grow with the thread count).
// - Debian's Abseil is built with Mutex deadlock detection on, which takes a
//   global lock on every Mutex operation; production binaries turn it off
//   (tests keep it: it finds lock-order inversions).
void TuneProcessForBlockIo();

}  // namespace kvdepot

#endif  // KVDEPOT_STORAGE_PROCESS_TUNING_H_
