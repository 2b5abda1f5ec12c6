/* The entry programs of the allocators other than glibc (jemalloc, tcmalloc, mimalloc, a malloc in
 * the executable) and of C++'s operator new/delete: one per (call, argument layout), named
 * <call>_<layout> as pymtrace/target/allocators.py's tables name them (tests/unit/test_allocators.py
 * checks the two against each other). Each program that probes such functions includes this file
 * where its entry programs go, after defining:
 *   AL_WANT(name), AL_CXX_WANT(name)   1 (in #if) to compile the entry NAME of the first / second list
 *   AL_ENTRY(name, type, size, ptr, align, flags)         a C allocator's entry program NAME
 *   AL_CXX_ENTRY(name, type, as_type, size, ptr, align)   an operator new/delete's
 * type is a CALL_* (malloc_stats.h's CALL_NEW.. for C++; as_type is the dj/malloc call the variant
 * is recorded as: new -> malloc, aligned new -> memalign, delete -> free), size the bytes requested,
 * ptr the pointer argument (the block of realloc or a free, posix_memalign's memptr), align the
 * alignment asked for; an argument the function does not have is 0. Layouts: s1/s2 size in
 * argument 1/2, n1s2 count * size, p1s2 (ptr, size), p1s3 posix_memalign's (memptr, alignment,
 * size), x xallocx's (ptr, size, extra, flags), p1 a free's pointer, nest the same for a free-type
 * function that calls another probed one (it gets a return probe). No include guard on the lists:
 * each includer expands them with its own macros. */
#ifndef PYMTRACE_ALLOCATORS_H
#define PYMTRACE_ALLOCATORS_H
#define AL_NOFAIL 1 /* resizes in place and returns a size (xallocx): never fails, the block stays */
#define AL_LEAF   2 /* a free that calls no other probed function: entry probe only */
#endif

#if AL_WANT(malloc_s1)
AL_ENTRY(malloc_s1, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0, 0)
#endif
#if AL_WANT(malloc_n1s2)
AL_ENTRY(malloc_n1s2, CALL_MALLOC, (u64)PT_REGS_PARM1(ctx) * (u64)PT_REGS_PARM2(ctx), 0, 0, 0)
#endif
#if AL_WANT(calloc_n1s2)
AL_ENTRY(calloc_n1s2, CALL_CALLOC, (u64)PT_REGS_PARM1(ctx) * (u64)PT_REGS_PARM2(ctx), 0, 0, 0)
#endif
#if AL_WANT(calloc_s1)
AL_ENTRY(calloc_s1, CALL_CALLOC, PT_REGS_PARM1(ctx), 0, 0, 0)
#endif
#if AL_WANT(realloc_p1s2)
AL_ENTRY(realloc_p1s2, CALL_REALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx), 0, 0)
#endif
#if AL_WANT(realloc_x)
AL_ENTRY(realloc_x, CALL_REALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx), 0, AL_NOFAIL)
#endif
#if AL_WANT(memalign_s1) /* (size, alignment): mi_malloc_aligned, mi_zalloc_aligned */
AL_ENTRY(memalign_s1, CALL_MEMALIGN, PT_REGS_PARM1(ctx), 0, PT_REGS_PARM2(ctx), 0)
#endif
#if AL_WANT(memalign_s2)
AL_ENTRY(memalign_s2, CALL_MEMALIGN, PT_REGS_PARM2(ctx), 0, PT_REGS_PARM1(ctx), 0)
#endif
#if AL_WANT(posix_memalign_p1s3)
AL_ENTRY(posix_memalign_p1s3, CALL_POSIX_MEMALIGN, PT_REGS_PARM3(ctx), PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx),
         0)
#endif
#if AL_WANT(valloc_s1)
AL_ENTRY(valloc_s1, CALL_VALLOC, PT_REGS_PARM1(ctx), 0, 0, 0)
#endif
#if AL_WANT(pvalloc_s1)
AL_ENTRY(pvalloc_s1, CALL_PVALLOC, PT_REGS_PARM1(ctx), 0, 0, 0)
#endif
#if AL_WANT(free_p1)
AL_ENTRY(free_p1, CALL_FREE, 0, PT_REGS_PARM1(ctx), 0, AL_LEAF)
#endif
#if AL_WANT(free_nest)
AL_ENTRY(free_nest, CALL_FREE, 0, PT_REGS_PARM1(ctx), 0, 0)
#endif

/* C++ operator new/delete (allocators.py CXX), every variant with a return probe */
#if AL_CXX_WANT(new_s1)
AL_CXX_ENTRY(new_s1, CALL_NEW, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0)
#endif
#if AL_CXX_WANT(new_array_s1)
AL_CXX_ENTRY(new_array_s1, CALL_NEW_ARRAY, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0)
#endif
#if AL_CXX_WANT(new_nothrow_s1)
AL_CXX_ENTRY(new_nothrow_s1, CALL_NEW_NOTHROW, CALL_MALLOC, PT_REGS_PARM1(ctx), 0, 0)
#endif
#if AL_CXX_WANT(new_aligned_s1)
AL_CXX_ENTRY(new_aligned_s1, CALL_NEW_ALIGNED, CALL_MEMALIGN, PT_REGS_PARM1(ctx), 0, PT_REGS_PARM2(ctx))
#endif
#if AL_CXX_WANT(delete_p1)
AL_CXX_ENTRY(delete_p1, CALL_DELETE, CALL_FREE, 0, PT_REGS_PARM1(ctx), 0)
#endif
#if AL_CXX_WANT(delete_array_p1)
AL_CXX_ENTRY(delete_array_p1, CALL_DELETE_ARRAY, CALL_FREE, 0, PT_REGS_PARM1(ctx), 0)
#endif
#if AL_CXX_WANT(delete_sized_p1)
AL_CXX_ENTRY(delete_sized_p1, CALL_DELETE_SIZED, CALL_FREE, 0, PT_REGS_PARM1(ctx), 0)
#endif
#if AL_CXX_WANT(delete_aligned_p1)
AL_CXX_ENTRY(delete_aligned_p1, CALL_DELETE_ALIGNED, CALL_FREE, 0, PT_REGS_PARM1(ctx), 0)
#endif
