/* pymtrace's unwinder and symbolizer (pymtrace/tracee/unwind.py loads it with ctypes).
 *
 * One session per traced process: a libdwfl session built from the process's captured
 * /proc/PID/maps, whose module files are the file descriptors captured while the process lived
 * (opened through /proc/PID/map_files: the exact inode mapped, even deleted or replaced), so a
 * session unwinds and symbolizes after the process is gone. Unwinding runs libdwfl's CFI
 * unwinder (dwfl_attach_state + dwfl_getthread_frames) over registers and a copy of the stack
 * taken at the probe: no Python callback per frame or per memory read.
 *
 * Everything mutable lives in the session: sessions are independent, and one session is used
 * by one thread at a time (the Python side holds a lock).
 *
 * Build: gcc -O2 -shared -fPIC unwind.c -ldw -lelf -ldl (nativebuild.py does it). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <dwarf.h>
#include <elfutils/libdw.h>
#include <elfutils/libdwelf.h>
#include <elfutils/libdwfl.h>
#include <fcntl.h>
#include <libelf.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_BUILD_ID 64

/* The unwind cache (pmt_unwind): a decision tree over what a deterministic unwind looks at. An
 * unwind's result depends only on ip, on the registers it bases addresses on (sp, and bp/bx/
 * r12-r15 when they point into the stack) and on the stack words it reads, at sp-relative
 * offsets that are themselves fixed by what came before. Each node asks one question (ip, a
 * register's sp-relative value, or the word at sp + offset); edges are keyed by the answer;
 * a leaf is a result. A lookup walks the tree reading the new copy: on a hit no CFI is
 * evaluated. Only complete unwinds (every read inside the copy, every frame in a known file)
 * are cached, so a hit is exactly what libdwfl would compute. A word read is answered by its
 * value when it was a return address; any other word read (a saved register) by its class: an
 * address near the copied stack (sp-relative: it may be a later frame's base) or "anything
 * else" - such a value cannot be the base of a read inside the copy, so it cannot change the
 * frames of a complete unwind; per-call values (heap pointers in saved registers) then still hit. Bounded: at PMT_CACHE_NODES nodes
 * or PMT_CACHE_PCS cached frames nothing more is added. */
#define PMT_CACHE_NODES (1 << 18)
#define PMT_CACHE_PCS   (1 << 20)
#define PMT_MAX_READS   2048
#define PMT_ASK_LEAF    INT32_MIN
#define PMT_ASK_NONE    (INT32_MIN + 1) /* a node whose question is not known yet */
#define PMT_ASK_IP      -1              /* then -2 - r for regs[2 + r], r = 0..5 (bp bx r12 r13 r14 r15) */
#define PMT_OUTSIDE     0xffffffffffffffffull /* a register not pointing into the copy */
#define PMT_NEAR        65536        /* a value within this of the copied stack may be an address in it */
#define PMT_STACK_TAG   (1ull << 63) /* answer: a stack address, as (value - sp) | tag */
#define PMT_ANY         (1ull << 62) /* answer: a value neither near the stack nor a return address */

struct pmt_node {
    int32_t ask;    /* PMT_ASK_*, or the byte offset from sp of the word read */
    int32_t result; /* leaf: index into results */
    int32_t wild;   /* a read whose value was no return address: only its class matters */
};
struct pmt_edge {
    uint64_t value;
    uint32_t parent; /* 0: empty slot (node 0, the root, is nobody's child) */
    uint32_t child;
};
struct pmt_result {
    uint32_t first, n; /* frames at pcs[first ..], files[first ..] */
};
struct pmt_cache {
    struct pmt_node *nodes;
    uint32_t nnodes;
    struct pmt_edge *edges; /* open addressing, 2 * PMT_CACHE_NODES slots */
    struct pmt_result *results;
    uint32_t nresults;
    uint64_t *pcs;
    int32_t *files;
    uint32_t npcs;
    int full;
    int off; /* pmt_cache_enable(s, 0): every unwind runs libdwfl (benchmarks) */
    uint64_t hits, misses;
};
#define PMT_EDGE_SLOTS (2 * PMT_CACHE_NODES)

/* One ELF file the process mapped: its name as /proc/PID/maps shows it, and either a captured
 * descriptor or (the vdso) a copy of its bytes. */
struct pmt_file {
    struct pmt_session *session;
    char *name;
    int fd;      /* -1 for an in-memory image */
    void *image; /* the vdso's bytes, owned */
    size_t image_len;
    unsigned char build_id[MAX_BUILD_ID];
    int build_id_len; /* 0: the file has none; -1: the file is not a readable ELF */
    int index;        /* this file's number in the session (what pmt_unwind reports) */
    Dwarf_Addr bias;  /* load bias, valid once has_bias */
    int has_bias;
    Dwfl_Module *module;  /* the module reported for it, NULL if none (set by pmt_report) */
    struct pmt_sym *syms; /* its symbol table sorted by address (symbol_at), built on first use */
    int nsyms;            /* -1: not built yet */
};

/* One symbol of a file, by address: libdwfl's dwfl_module_addrinfo scans the whole table per
 * lookup (~1.3 ms in cc1's 100k symbols), a binary search over this costs a microsecond. */
struct pmt_sym {
    GElf_Addr addr; /* its address in the process (the module's bias added) */
    GElf_Xword size;
    const char *name; /* libdwfl's string, valid while the session lives */
    int rank;         /* at one address: a global function first */
};

struct pmt_session {
    Dwfl *dwfl;
    Dwfl_Callbacks callbacks;
    struct pmt_file **files; /* pointers: stable while the array grows */
    int nfiles, capacity;
    /* the unwind in progress */
    pid_t tid;
    const uint8_t *stack;
    size_t stack_len;
    Dwarf_Word sp;
    const uint64_t *regs;
    uint64_t *out_pc;
    int32_t *out_file;
    int n, max;
    int read_failed;              /* a read fell outside the copy: the unwind may have stopped short */
    int32_t reads[PMT_MAX_READS]; /* sp-relative offsets of this unwind's reads, in order */
    uint64_t read_values[PMT_MAX_READS];
    int nreads;                  /* > PMT_MAX_READS: too many to cache */
    uint64_t ret[PMT_MAX_READS]; /* the frames' raw pcs (return addresses) of this unwind */
    int nret;
    struct pmt_cache cache;
};

/* Build ID of an open ELF, into file->build_id. */
static void read_build_id(struct pmt_file *file, Elf *elf) {
    const void *id = NULL;
    ssize_t len = dwelf_elf_gnu_build_id(elf, &id);
    if (len > 0 && len <= MAX_BUILD_ID) {
        memcpy(file->build_id, id, (size_t)len);
        file->build_id_len = (int)len;
    } else {
        file->build_id_len = 0;
    }
}

static int cache_init(struct pmt_cache *c);
static void cache_free(struct pmt_cache *c);

/* Read-only ELF handle of FILE, or NULL. Never ELF_C_READ_MMAP_PRIVATE (libdwfl's default): the
 * kernel applies other tools' uprobe reference counters to writable private mappings of a probed
 * file, which corrupts the bytes we would read (docs/heap.md, "How stacks are unwound"). */
static Elf *open_elf(struct pmt_file *file, int *fd_out) {
    *fd_out = -1;
    if (file->fd < 0) {
        if (!file->image) return NULL;
        return elf_memory(file->image, file->image_len);
    }
    int fd = fcntl(file->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return NULL;
    Elf *elf = elf_begin(fd, ELF_C_READ_MMAP, NULL);
    if (!elf || elf_kind(elf) != ELF_K_ELF) {
        if (elf) elf_end(elf);
        close(fd);
        return NULL;
    }
    *fd_out = fd;
    return elf;
}

static struct pmt_file *find_file(struct pmt_session *s, const char *name) {
    for (int i = 0; i < s->nfiles; i++)
        if (strcmp(s->files[i]->name, name) == 0) return s->files[i];
    return NULL;
}

/* libdwfl's find_elf: only the files captured at pmt_add_file, and only while their build ID is
 * the one captured (a file rewritten in place keeps its inode but not its contents). */
static int find_elf(Dwfl_Module *mod, void **userdata, const char *name, Dwarf_Addr base, char **file_name,
                    Elf **elfp) {
    (void)mod;
    (void)base;
    struct pmt_file *file = *userdata;
    if (!file || file->build_id_len < 0) return -1;
    int fd;
    Elf *elf = open_elf(file, &fd);
    if (!elf) return -1;
    const void *id = NULL;
    ssize_t len = dwelf_elf_gnu_build_id(elf, &id);
    if (len < 0) len = 0;
    if (len != file->build_id_len || (len > 0 && memcmp(id, file->build_id, (size_t)len) != 0)) {
        elf_end(elf);
        if (fd >= 0) close(fd);
        return -1;
    }
    *file_name = strdup(name);
    *elfp = elf;
    return fd;
}

/* Attach each reported module to its captured file (module userdata), so find_elf knows it. */
static int attach_file(Dwfl_Module *mod, void **userdata, const char *name, Dwarf_Addr start, void *arg) {
    (void)start;
    if (!*userdata) *userdata = find_file(arg, name);
    if (*userdata) ((struct pmt_file *)*userdata)->module = mod;
    return DWARF_CB_OK;
}

struct pmt_session *pmt_open(void) {
    struct pmt_session *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    elf_version(EV_CURRENT);
    s->callbacks.find_elf = find_elf;
    s->callbacks.find_debuginfo = dwfl_standard_find_debuginfo;
    s->dwfl = dwfl_begin(&s->callbacks);
    if (!s->dwfl) {
        free(s);
        return NULL;
    }
    if (cache_init(&s->cache) != 0) { /* no cache: every unwind runs libdwfl */
        cache_free(&s->cache);
        memset(&s->cache, 0, sizeof s->cache);
    }
    return s;
}

/* Adds a file the process maps: FD (owned by the session from now on) or, when FD < 0, IMAGE
 * (copied; the vdso). Returns the file's index, or -1 without memory. Its build ID is read now. */
int pmt_add_file(struct pmt_session *s, const char *name, int fd, const void *image, size_t image_len) {
    if (s->nfiles == s->capacity) {
        int capacity = s->capacity ? 2 * s->capacity : 32;
        struct pmt_file **files = realloc(s->files, (size_t)capacity * sizeof *files);
        if (!files) return -1;
        s->files = files;
        s->capacity = capacity;
    }
    struct pmt_file *file = calloc(1, sizeof *file);
    if (!file) return -1;
    file->session = s;
    file->name = strdup(name);
    file->fd = fd;
    file->nsyms = -1;
    if (fd < 0 && image && image_len) {
        file->image = malloc(image_len);
        if (file->image) {
            memcpy(file->image, image, image_len);
            file->image_len = image_len;
        }
    }
    int elf_fd;
    Elf *elf = open_elf(file, &elf_fd);
    if (elf) {
        read_build_id(file, elf);
        elf_end(elf);
        if (elf_fd >= 0) close(elf_fd);
    } else {
        file->build_id_len = -1;
    }
    file->index = s->nfiles;
    s->files[s->nfiles++] = file;
    return file->index;
}

/* The build ID read at pmt_add_file into OUT (MAX_BUILD_ID bytes): its length, 0 if none, -1
 * if the file was not a readable ELF. */
int pmt_file_build_id(struct pmt_session *s, int index, unsigned char *out) {
    if (index < 0 || index >= s->nfiles) return -1;
    struct pmt_file *file = s->files[index];
    if (file->build_id_len > 0) memcpy(out, file->build_id, (size_t)file->build_id_len);
    return file->build_id_len;
}

static pid_t next_thread(Dwfl *dwfl, void *arg, void **thread_arg) {
    (void)dwfl;
    if (*thread_arg) return 0;
    *thread_arg = arg;
    return ((struct pmt_session *)arg)->tid;
}

static bool get_thread(Dwfl *dwfl, pid_t tid, void *arg, void **thread_arg) {
    (void)dwfl;
    (void)tid;
    *thread_arg = arg;
    return true;
}

/* Memory reads come from the copied stack only: anything else is unknown. libdwfl takes a return
 * address it cannot read for the outermost frame's (undefined) one and ends without an error,
 * so a failed read is remembered: that unwind is not complete. */
static bool memory_read(Dwfl *dwfl, Dwarf_Addr addr, Dwarf_Word *result, void *arg) {
    (void)dwfl;
    struct pmt_session *s = arg;
    if (addr < s->sp || addr - s->sp > s->stack_len || s->stack_len - (addr - s->sp) < sizeof *result) {
        s->read_failed = 1;
        return false;
    }
    memcpy(result, s->stack + (addr - s->sp), sizeof *result);
    if (s->nreads < PMT_MAX_READS) {
        s->reads[s->nreads] = (int32_t)(addr - s->sp);
        s->read_values[s->nreads] = *result;
    }
    s->nreads++;
    return true;
}

/* regs: ip sp bp bx r12 r13 r14 r15; DWARF x86-64 numbers: bx 3, bp 6, sp 7, r12-r15 12-15.
 * Only these are set: the others are unknown at the probe, not zero. */
static bool set_initial_registers(Dwfl_Thread *thread, void *arg) {
    struct pmt_session *s = arg;
    const uint64_t *r = s->regs;
    Dwarf_Word bx = r[3], bp_sp[2] = {r[2], r[1]}, r12_15[4] = {r[4], r[5], r[6], r[7]};
    dwfl_thread_state_register_pc(thread, r[0]);
    return dwfl_thread_state_registers(thread, 3, 1, &bx) &&
           dwfl_thread_state_registers(thread, 6, 2, bp_sp) &&
           dwfl_thread_state_registers(thread, 12, 4, r12_15);
}

static const Dwfl_Thread_Callbacks thread_callbacks = {
    next_thread, get_thread, memory_read, set_initial_registers, NULL, NULL,
};

/* Reports the modules of MAPS (the /proc/PID/maps lines of ELF files, as text) and attaches
 * the unwinder at the first call. Call again with the whole new maps after a dlopen. A vdso
 * added with pmt_add_file is reported at [VDSO_START, VDSO_END) when VDSO_END > VDSO_START.
 * Returns 0, or -1 (pmt_errmsg says why). */
int pmt_report(struct pmt_session *s, int pid, const char *maps, size_t len, uint64_t vdso_start,
               uint64_t vdso_end) {
    int rc = 0;
    dwfl_report_begin(s->dwfl);
    if (len) { /* fmemopen of 0 bytes fails (EINVAL) on older glibc */
        FILE *f = fmemopen((void *)maps, len, "r");
        rc = f ? dwfl_linux_proc_maps_report(s->dwfl, f) : -1;
        if (f) fclose(f);
    }
    if (rc == 0 && vdso_end > vdso_start && find_file(s, "[vdso]"))
        if (!dwfl_report_module(s->dwfl, "[vdso]", vdso_start, vdso_end)) rc = -1;
    dwfl_report_end(s->dwfl, NULL, NULL);
    if (rc != 0) return -1;
    for (int i = 0; i < s->nfiles; i++) s->files[i]->module = NULL; /* unmapped ones stay NULL */
    dwfl_getmodules(s->dwfl, attach_file, s, 0);
    if (dwfl_pid(s->dwfl) <= 0 && !dwfl_attach_state(s->dwfl, NULL, pid, &thread_callbacks, s)) return -1;
    return 0;
}

/* Load bias of MOD's file, cached in the file. */
static struct pmt_file *module_file(Dwfl_Module *mod, Dwarf_Addr *bias) {
    void **userdata = NULL;
    dwfl_module_info(mod, &userdata, NULL, NULL, NULL, NULL, NULL, NULL);
    struct pmt_file *file = userdata ? *userdata : NULL;
    if (!file) return NULL;
    if (!file->has_bias) {
        if (!dwfl_module_getelf(mod, &file->bias)) return NULL;
        file->has_bias = 1;
    }
    *bias = file->bias;
    return file;
}

static int on_frame(Dwfl_Frame *frame, void *arg) {
    struct pmt_session *s = arg;
    Dwarf_Addr pc;
    bool activation;
    if (!dwfl_frame_pc(frame, &pc, &activation)) return -1;
    if (s->nret < PMT_MAX_READS) s->ret[s->nret++] = pc;
    if (!activation) pc -= 1; /* a return address: the call is the instruction before it */
    Dwfl_Module *mod = dwfl_addrmodule(s->dwfl, pc);
    Dwarf_Addr bias = 0;
    struct pmt_file *file = mod ? module_file(mod, &bias) : NULL;
    s->out_pc[s->n] = file ? pc - bias : pc;
    s->out_file[s->n] = file ? file->index : -1;
    s->n++;
    return s->n < s->max ? DWARF_CB_OK : DWARF_CB_ABORT;
}

static uint64_t edge_hash(uint32_t parent, uint64_t value) {
    uint64_t h = (value ^ ((uint64_t)parent << 32 | parent)) * 0x9e3779b97f4a7c15ull;
    return h ^ (h >> 29);
}

static uint32_t edge_find(struct pmt_cache *c, uint32_t parent, uint64_t value, int create) {
    uint64_t i = edge_hash(parent, value) & (PMT_EDGE_SLOTS - 1);
    for (;; i = (i + 1) & (PMT_EDGE_SLOTS - 1)) {
        struct pmt_edge *e = &c->edges[i];
        if (e->parent == 0 && e->child == 0) {
            if (!create || c->nnodes >= PMT_CACHE_NODES) return 0;
            e->parent = parent;
            e->value = value;
            e->child = c->nnodes;
            c->nodes[c->nnodes].ask = PMT_ASK_NONE; /* unasked yet */
            c->nodes[c->nnodes].result = -1;
            c->nnodes++;
            return e->child;
        }
        if (e->parent == parent && e->value == value) return e->child;
    }
}

static int cache_init(struct pmt_cache *c) {
    c->nodes = calloc(PMT_CACHE_NODES, sizeof *c->nodes);
    c->edges = calloc(PMT_EDGE_SLOTS, sizeof *c->edges);
    c->results = calloc(PMT_CACHE_NODES, sizeof *c->results);
    c->pcs = calloc(PMT_CACHE_PCS, sizeof *c->pcs);
    c->files = calloc(PMT_CACHE_PCS, sizeof *c->files);
    if (!c->nodes || !c->edges || !c->results || !c->pcs || !c->files) return -1;
    c->nodes[0].ask = PMT_ASK_IP;
    c->nodes[0].result = -1;
    c->nnodes = 1;
    return 0;
}

static void cache_free(struct pmt_cache *c) {
    free(c->nodes);
    free(c->edges);
    free(c->results);
    free(c->pcs);
    free(c->files);
}

/* The answer for a word V read at a node (WILD: see struct pmt_node). */
static uint64_t word_answer(uint64_t v, uint64_t sp, size_t len, int wild) {
    if (v - sp + PMT_NEAR < len + 2 * PMT_NEAR) return PMT_STACK_TAG | ((v - sp) & ~PMT_STACK_TAG);
    return wild ? PMT_ANY : v;
}

/* The answer to node question ASK for this unwind's inputs; 0 if it cannot be answered (a
 * read outside the copy). */
static int cache_answer(const uint64_t *regs, const uint8_t *stack, size_t len, int32_t ask, int wild,
                        uint64_t *value) {
    if (ask == PMT_ASK_IP) {
        *value = regs[0];
    } else if (ask < 0 && ask >= -7) {
        uint64_t r = regs[2 + (-2 - ask)];
        *value = r >= regs[1] && r - regs[1] <= len ? r - regs[1] : PMT_OUTSIDE;
    } else if (ask >= 0) {
        if ((size_t)ask > len || len - (size_t)ask < sizeof(uint64_t)) return 0;
        uint64_t v;
        memcpy(&v, stack + ask, sizeof v);
        *value = word_answer(v, regs[1], len, wild);
    } else {
        return 0;
    }
    return 1;
}

/* The cached result for these inputs, or -1. */
static int cache_lookup(struct pmt_cache *c, const uint64_t *regs, const uint8_t *stack, size_t len) {
    if (!c->nodes || c->off) return -1;
    uint32_t node = 0;
    for (int steps = 0; steps < PMT_MAX_READS + 8; steps++) {
        int32_t ask = c->nodes[node].ask;
        if (ask == PMT_ASK_LEAF) return c->nodes[node].result;
        uint64_t value;
        if (!cache_answer(regs, stack, len, ask, c->nodes[node].wild, &value)) return -1;
        node = edge_find(c, node, value, 0);
        if (!node) return -1;
    }
    return -1;
}

/* Remembers the complete unwind just made (s->reads, s->out_*): its result index, or -1. */
static int cache_insert(struct pmt_session *s) {
    struct pmt_cache *c = &s->cache;
    if (!c->nodes || c->off || c->full || s->nreads > PMT_MAX_READS) return -1;
    if (c->npcs + (uint32_t)s->n > PMT_CACHE_PCS || c->nresults >= PMT_CACHE_NODES) {
        c->full = 1;
        return -1;
    }
    uint32_t node = 0;
    /* the questions in order: ip, the six registers, then the reads */
    for (int step = 0; step < 7 + s->nreads; step++) {
        int32_t ask = step == 0 ? PMT_ASK_IP : step < 7 ? -1 - step : s->reads[step - 7];
        if (c->nodes[node].ask == PMT_ASK_NONE) {
            int wild = 0;
            if (step >= 7) { /* a return address is asked exactly, other words by class */
                wild = 1;
                for (int i = 0; i < s->nret; i++) wild &= s->ret[i] != s->read_values[step - 7];
            }
            c->nodes[node].ask = ask;
            c->nodes[node].wild = wild;
        } else if (c->nodes[node].ask != ask) {
            return -1; /* not the unwind we thought: leave it */
        }
        uint64_t value;
        if (step < 7) {
            if (!cache_answer(s->regs, s->stack, s->stack_len, ask, 0, &value)) return -1;
        } else {
            value = word_answer(s->read_values[step - 7], s->sp, s->stack_len, c->nodes[node].wild);
        }
        node = edge_find(c, node, value, 1);
        if (!node) {
            c->full = 1;
            return -1;
        }
    }
    if (c->nodes[node].ask == PMT_ASK_LEAF) return c->nodes[node].result;
    if (c->nodes[node].ask != PMT_ASK_NONE) return -1;
    struct pmt_result *r = &c->results[c->nresults];
    r->first = c->npcs;
    r->n = (uint32_t)s->n;
    memcpy(c->pcs + c->npcs, s->out_pc, (size_t)s->n * sizeof *c->pcs);
    memcpy(c->files + c->npcs, s->out_file, (size_t)s->n * sizeof *c->files);
    c->npcs += (uint32_t)s->n;
    c->nodes[node].ask = PMT_ASK_LEAF;
    c->nodes[node].result = (int32_t)c->nresults;
    return (int)c->nresults++;
}

/* Unwinds thread TID from REGS (ip sp bp bx r12 r13 r14 r15) over STACK, the LEN bytes copied
 * from sp upward. Writes up to MAX frames leaf first: OUT_FILE the file index (-1: in no
 * captured file, OUT_PC then absolute) and OUT_PC the file-relative pc (ELF virtual address,
 * return addresses minus one). *COMPLETE = 1 when the unwind reached the outermost frame
 * without needing memory outside the copy. *RESULT: the cached result's number (the same
 * number for the same frames: callers intern by it), or -1 when this unwind is not cached. */
int pmt_unwind(struct pmt_session *s, int tid, const uint64_t *regs, const void *stack, size_t len,
               uint64_t *out_pc, int32_t *out_file, int max, int *complete, int *result) {
    *result = -1;
    int hit = cache_lookup(&s->cache, regs, stack, len);
    if (hit >= 0) {
        struct pmt_result *r = &s->cache.results[hit];
        int n = (int)r->n < max ? (int)r->n : max;
        memcpy(out_pc, s->cache.pcs + r->first, (size_t)n * sizeof *out_pc);
        memcpy(out_file, s->cache.files + r->first, (size_t)n * sizeof *out_file);
        *complete = 1;
        *result = hit;
        s->cache.hits++;
        return n;
    }
    s->cache.misses++;
    s->nreads = 0;
    s->nret = 0;
    s->tid = tid;
    s->regs = regs;
    s->stack = stack;
    s->stack_len = len;
    s->sp = regs[1];
    s->out_pc = out_pc;
    s->out_file = out_file;
    s->n = 0;
    s->max = max;
    s->read_failed = 0;
    /* 0: the last frame's return address is undefined by its CFI (_start, clone, thread start) */
    int rc = max > 0 ? dwfl_getthread_frames(s->dwfl, tid, on_frame, s) : -1;
    *complete = rc == 0 && !s->read_failed;
    if (*complete && s->n < max) {
        int known = 1;
        for (int i = 0; i < s->n; i++) known &= out_file[i] >= 0;
        if (known) *result = cache_insert(s);
    }
    s->stack = NULL;
    return s->n;
}

/* -- reading a BPF ring buffer in batches ------------------------------------------------- */

#define PMT_RB_BUSY    (1u << 31)
#define PMT_RB_DISCARD (1u << 30)
#define PMT_ROW_HEAD   40 /* bytes of each record copied into its row */

/* One ring record, for the caller: where its payload is (offset in the data pages), its
 * length, the unwind cache's result for a sample (-1: not cached, -2: not a sample of a
 * process with a session), and the record's first PMT_ROW_HEAD bytes. */
struct pmt_row {
    uint64_t off;
    uint32_t len;
    int32_t result;
    uint8_t head[PMT_ROW_HEAD];
};

/* Scans the committed records of a BPF ring buffer from consumer position CONS up to PROD
 * (DATA: its data pages, mapped twice in a row as the kernel does; MASK: their size - 1),
 * into up to MAX ROWS, stopping at a record still being written and after any record that is
 * neither a sample nor of SHORT_TYPE (the caller handles exec/fork/exit before the records
 * after them). A sample
 * record (u32 type == SAMPLE_TYPE at 0, u32 pid at 4, 8 u64 registers at REGS_OFF, u32 stack
 * length at STACK_LEN_OFF, the stack from HEADER on) of a pid in PIDS[] is looked up in that
 * pid's session's unwind cache: no libdwfl work, nothing added. The consumer position is the
 * caller's to advance (to *NEXT) once it is done with the rows: the records stay in place
 * until then. Returns the number of rows. */
int pmt_ring_scan(const uint8_t *data, uint64_t mask, uint64_t cons, uint64_t prod, uint32_t sample_type,
                  uint32_t short_type, uint32_t regs_off, uint32_t stack_len_off, uint32_t header,
                  const int32_t *pids, struct pmt_session *const *sessions, int nsessions,
                  struct pmt_row *rows, int max, uint64_t *next) {
    int n = 0;
    while (cons < prod && n < max) {
        const uint8_t *rec = data + (cons & mask);
        uint32_t flags = __atomic_load_n((const uint32_t *)rec, __ATOMIC_ACQUIRE);
        if (flags & PMT_RB_BUSY) break;
        uint32_t len = flags & ~(PMT_RB_BUSY | PMT_RB_DISCARD);
        cons += ((uint64_t)len + 8 + 7) & ~7ull;
        if (flags & PMT_RB_DISCARD) continue;
        struct pmt_row *row = &rows[n++];
        const uint8_t *payload = rec + 8;
        row->off = (uint64_t)(payload - data);
        row->len = len;
        row->result = -2;
        memset(row->head, 0, sizeof row->head);
        memcpy(row->head, payload, len < PMT_ROW_HEAD ? len : PMT_ROW_HEAD);
        uint32_t type = 0, pid = 0, stack_len = 0;
        if (len >= 8) {
            memcpy(&type, payload, 4);
            memcpy(&pid, payload + 4, 4);
        }
        if (type == short_type) continue;               /* a short record (a free): the caller's, in order */
        if (len < header || type != sample_type) break; /* the caller handles it first */
        memcpy(&stack_len, payload + stack_len_off, 4);
        if (stack_len > len - header) stack_len = len - header;
        for (int i = 0; i < nsessions; i++) {
            if ((uint32_t)pids[i] != pid) continue;
            uint64_t regs[8];
            memcpy(regs, payload + regs_off, sizeof regs);
            row->result = cache_lookup(&sessions[i]->cache, regs, payload + header, stack_len);
            if (row->result >= 0) sessions[i]->cache.hits++;
            break;
        }
    }
    *next = cons;
    return n;
}

/* Switches the unwind cache on (ON != 0, the default) or off (benchmarks). */
void pmt_cache_enable(struct pmt_session *s, int on) {
    s->cache.off = !on;
}

/* The cache's hits and misses so far (for benchmarks). */
void pmt_cache_stats(struct pmt_session *s, uint64_t *hits, uint64_t *misses) {
    *hits = s->cache.hits;
    *misses = s->cache.misses;
}

const char *pmt_errmsg(void) {
    return dwfl_errmsg(-1);
}

/* -- symbolization -------------------------------------------------------------------------- */

typedef char *(*demangle_fn)(const char *, char *, size_t *, int *);
static demangle_fn cxa_demangle; /* set once (pthread_once), read-only afterwards */
static pthread_once_t demangle_once = PTHREAD_ONCE_INIT;

/* libstdc++'s demangler, found at run time: a C++ program has it loaded; otherwise the runtime
 * library (libstdc++6, present wherever BCC is) is loaded for it. Linking -lstdc++ would need
 * its development package. */
static void find_demangler(void) {
    void *f = dlsym(RTLD_DEFAULT, "__cxa_demangle");
    if (!f) {
        void *lib = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_LOCAL);
        if (lib) f = dlsym(lib, "__cxa_demangle");
    }
    cxa_demangle = (demangle_fn)f;
}

/* NAME as shown: without a symbol version ("@GLIBC_2.2.5", "@@GLIBCXX_3.4"), demangled.
 * Returns a malloc'd string. */
static char *display_name(const char *name) {
    size_t len = strcspn(name, "@");
    char *plain = strndup(name, len);
    if (!plain || strncmp(plain, "_Z", 2) != 0) return plain;
    pthread_once(&demangle_once, find_demangler);
    if (!cxa_demangle) return plain;
    int status = -1;
    char *demangled = cxa_demangle(plain, NULL, NULL, &status);
    if (status != 0 || !demangled) {
        free(demangled);
        return plain;
    }
    free(plain);
    return demangled;
}

/* Appends FIELD and its NUL to OUT (capacity CAP, used *USED); 0, or -1 when it does not fit. */
static int put(char *out, size_t cap, size_t *used, const char *field) {
    size_t len = strlen(field) + 1;
    if (cap - *used < len) return -1;
    memcpy(out + *used, field, len);
    *used += len;
    return 0;
}

static int put_frame(char *out, size_t cap, size_t *used, const char *raw_name, const char *file, int line) {
    char *name = display_name(raw_name ? raw_name : "");
    char number[16];
    snprintf(number, sizeof number, "%d", line);
    int rc = name ? put(out, cap, used, name) : -1;
    free(name);
    if (rc == 0) rc = put(out, cap, used, file ? file : "");
    if (rc == 0) rc = put(out, cap, used, number);
    return rc;
}

/* The innermost function-like DIE among SCOPES (an inlined instance or a function). */
static int function_scope(Dwarf_Die *scopes, int n, int from, Dwarf_Die *out) {
    for (int i = from; i < n; i++) {
        int tag = dwarf_tag(&scopes[i]);
        if (tag == DW_TAG_inlined_subroutine || tag == DW_TAG_subprogram) {
            *out = scopes[i];
            return 1;
        }
    }
    return 0;
}

/* Symbols by address; at one address by rank (sym_rank: a global function first). */
static int sym_order(const void *a, const void *b) {
    const struct pmt_sym *x = a, *y = b;
    if (x->addr != y->addr) return x->addr < y->addr ? -1 : 1;
    return x->rank - y->rank;
}

static int sym_rank(const GElf_Sym *sym) {
    int bind = GELF_ST_BIND(sym->st_info), type = GELF_ST_TYPE(sym->st_info);
    return (bind == STB_GLOBAL ? 0 : bind == STB_WEAK ? 1 : 2) * 2 + (type == STT_FUNC ? 0 : 1);
}

/* FILE's symbols with an address (functions and objects), sorted; nsyms 0 if none. */
static void build_symbols(struct pmt_file *file, Dwfl_Module *mod) {
    file->nsyms = 0;
    int n = dwfl_module_getsymtab(mod);
    if (n <= 1) return;
    struct pmt_sym *syms = calloc((size_t)n, sizeof *syms);
    if (!syms) return;
    int k = 0;
    for (int i = 1; i < n; i++) {
        GElf_Sym sym;
        GElf_Addr addr;
        GElf_Word shndx;
        const char *name = dwfl_module_getsym_info(mod, i, &sym, &addr, &shndx, NULL, NULL);
        int type = GELF_ST_TYPE(sym.st_info);
        if (!name || !*name || shndx == SHN_UNDEF ||
            (type != STT_FUNC && type != STT_OBJECT && type != STT_NOTYPE))
            continue;
        syms[k++] = (struct pmt_sym){addr, sym.st_size, name, sym_rank(&sym)};
    }
    qsort(syms, (size_t)k, sizeof *syms, sym_order);
    file->syms = syms;
    file->nsyms = k;
}

/* The name of the symbol holding PC (an address in the process), as dwfl_module_addrinfo
 * would give it: the symbol whose range holds it (the innermost of nested ones, a global
 * function first at one address), else the nearest one below without a size; NULL if none. */
static const char *symbol_at(struct pmt_file *file, Dwfl_Module *mod, Dwarf_Addr pc) {
    if (file->nsyms < 0) build_symbols(file, mod);
    int lo = 0, hi = file->nsyms; /* the first symbol above pc */
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (file->syms[mid].addr <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    const char *sizeless = NULL;
    for (int i = lo - 1, seen = 0; i >= 0 && seen < 64; i--, seen++) {
        const struct pmt_sym *sym = &file->syms[i];
        if (sym->size && pc < sym->addr + sym->size) {
            /* the best-ranked symbol at this address */
            while (i > 0 && file->syms[i - 1].addr == sym->addr && file->syms[i - 1].size)
                sym = &file->syms[--i];
            return sym->name;
        }
        if (!sym->size && !sizeless && seen == 0) sizeless = sym->name;
    }
    return sizeless;
}

/* Frames of file INDEX's relative pc REL_PC, innermost first (inlined callees, then the
 * function), as NUL-terminated fields name, file, line (decimal) per frame into OUT (CAP
 * bytes). Names of inlined callees come from DWARF, the function's own name from the symbol
 * table when there is one (DWARF names differ: __GI___libc_malloc); "" when unknown.
 * Inlined frames need DWARF (debug info); without it one frame. Returns the number of frames,
 * or -1 when OUT is too small. */
int pmt_symbolize(struct pmt_session *s, int index, uint64_t rel_pc, char *out, size_t cap) {
    if (index < 0 || index >= s->nfiles || !s->files[index]->module) return 0;
    Dwfl_Module *mod = s->files[index]->module;
    Dwarf_Addr bias;
    if (!module_file(mod, &bias)) return 0;
    Dwarf_Addr pc = rel_pc + bias;
    const char *symbol = symbol_at(s->files[index], mod, pc);
    const char *file = NULL;
    int line = 0;
    Dwfl_Line *src = dwfl_module_getsrc(mod, pc);
    if (src) file = dwfl_lineinfo(src, NULL, &line, NULL, NULL, NULL);

    size_t used = 0;
    int n = 0;
    Dwarf_Addr cu_bias;
    Dwarf_Die *cu = dwfl_module_addrdie(mod, pc, &cu_bias);
    Dwarf_Die *scopes = NULL;
    int nscopes = cu ? dwarf_getscopes(cu, pc - cu_bias, &scopes) : 0;
    Dwarf_Die die;
    int found = nscopes > 0 && function_scope(scopes, nscopes, 0, &die);
    Dwarf_Files *srcfiles = NULL;
    size_t nsrcfiles = 0;
    if (found) dwarf_getsrcfiles(cu, &srcfiles, &nsrcfiles);
    /* each inlined instance: its name at the current position, then the position moves to its
     * call site (DW_AT_call_file/line) in the caller; climb the concrete DIE tree
     * (dwarf_getscopes_die): past an inlined instance dwarf_getscopes follows the abstract one */
    while (found && dwarf_tag(&die) == DW_TAG_inlined_subroutine && n < 64) {
        Dwarf_Attribute attr;
        const char *name = NULL;
        if (dwarf_attr_integrate(&die, DW_AT_linkage_name, &attr)) name = dwarf_formstring(&attr);
        if (!name) name = dwarf_diename(&die);
        if (put_frame(out, cap, &used, name, file, line) != 0) {
            free(scopes);
            return -1;
        }
        n++;
        Dwarf_Word file_index = 0, call_line = 0;
        if (dwarf_formudata(dwarf_attr(&die, DW_AT_call_file, &attr), &file_index) == 0 && srcfiles)
            file = dwarf_filesrc(srcfiles, file_index, NULL, NULL);
        if (dwarf_formudata(dwarf_attr(&die, DW_AT_call_line, &attr), &call_line) == 0) line = (int)call_line;
        Dwarf_Die *up = NULL;
        int nup = dwarf_getscopes_die(&die, &up);
        found = nup > 1 && function_scope(up, nup, 1, &die);
        free(up);
    }
    const char *name = symbol;
    if (!name && found) name = dwarf_diename(&die);
    int rc = put_frame(out, cap, &used, name, file, line);
    free(scopes);
    return rc == 0 ? n + 1 : -1;
}

/* Frees the session, its files and their descriptors. */
void pmt_close(struct pmt_session *s) {
    if (!s) return;
    dwfl_end(s->dwfl);
    cache_free(&s->cache);
    for (int i = 0; i < s->nfiles; i++) {
        if (s->files[i]->fd >= 0) close(s->files[i]->fd);
        free(s->files[i]->image);
        free(s->files[i]->syms);
        free(s->files[i]->name);
        free(s->files[i]);
    }
    free(s->files);
    free(s);
}
