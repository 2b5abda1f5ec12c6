/* Tiny C helper for the issue-13 prototype: libdwfl unwinding of a copied user stack without
 * a Python callback per memory read.  Build: gcc -O2 -shared -fPIC -o libshim.so shim.c -ldw */
#define _GNU_SOURCE
#include <elfutils/libdwfl.h>
#include <fcntl.h>
#include <libelf.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct shim {
    Dwfl *dwfl;
    Dwfl_Callbacks cb;
    int tid;
    const uint8_t *stack;
    size_t len;
    uint64_t sp;
    Dwarf_Word regs[17];
    uint64_t *out;
    int n, max;
};

/* Files captured while the process lived: path -> fd opened via /proc/PID/map_files/START-END
 * (the exact inode mapped, even after the file is deleted or replaced). */
#define MAXFILES 1024
static struct { char *path; int fd; } files[MAXFILES];
static int nfiles;

int shim_add_file(const char *path, int fd) {
    if (nfiles >= MAXFILES) return -1;
    files[nfiles].path = strdup(path);
    files[nfiles].fd = fd;
    nfiles++;
    return 0;
}

/* Open module files read-only ourselves.  libdwfl's default is elf_begin(ELF_C_READ_MMAP_PRIVATE),
 * a PROT_WRITE private mapping: the kernel applies uprobe reference counters (USDT semaphores,
 * ref_ctr_offset) of anyone's probes on that file to such mappings too, corrupting our view
 * (seen here: libc's ELF header byte 6 incremented -> "not a valid ELF file"). */
static int find_elf_ro(Dwfl_Module *mod, void **userdata, const char *name, Dwarf_Addr base,
                       char **file_name, Elf **elfp) {
    (void)mod; (void)userdata; (void)base;
    int fd = -1;
    for (int i = 0; i < nfiles; i++)
        if (strcmp(files[i].path, name) == 0) { fd = fcntl(files[i].fd, F_DUPFD_CLOEXEC, 0); break; }
    if (fd < 0) {
        struct stat st;
        if (name[0] != '/' || stat(name, &st) != 0 || !S_ISREG(st.st_mode)) return -1;
        fd = open(name, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return -1;
    }
    Elf *e = elf_begin(fd, ELF_C_READ_MMAP, NULL);
    if (!e || elf_kind(e) != ELF_K_ELF) { if (e) elf_end(e); close(fd); return -1; }
    *file_name = strdup(name);
    *elfp = e;
    return fd;
}

static pid_t next_thread(Dwfl *d, void *arg, void **targ) {
    (void)d;
    if (*targ) return 0;
    *targ = arg;
    return ((struct shim *)arg)->tid;
}
static bool get_thread(Dwfl *d, pid_t tid, void *arg, void **targ) {
    (void)d; (void)tid;
    *targ = arg;
    return true;
}
static bool memory_read(Dwfl *d, Dwarf_Addr addr, Dwarf_Word *res, void *arg) {
    (void)d;
    struct shim *s = arg;
    if (addr < s->sp || addr + 8 > s->sp + s->len) return false;
    memcpy(res, s->stack + (addr - s->sp), 8);
    return true;
}
static bool set_regs(Dwfl_Thread *t, void *arg) {
    struct shim *s = arg;
    dwfl_thread_state_register_pc(t, s->regs[16]);
    return dwfl_thread_state_registers(t, 0, 17, s->regs);
}
static const Dwfl_Thread_Callbacks tcb = {next_thread, get_thread, memory_read, set_regs, NULL, NULL};

static int frame_cb(Dwfl_Frame *f, void *arg) {
    struct shim *s = arg;
    Dwarf_Addr pc;
    bool act;
    if (!dwfl_frame_pc(f, &pc, &act)) return DWARF_CB_ABORT;
    s->out[s->n++] = act ? pc : pc - 1;
    return s->n < s->max ? DWARF_CB_OK : DWARF_CB_ABORT;
}

int shim_report(struct shim *s, const char *maps, size_t len) {
    FILE *f = fmemopen((void *)maps, len, "r");
    if (!f) return -1;
    dwfl_report_begin(s->dwfl);
    int rc = dwfl_linux_proc_maps_report(s->dwfl, f);
    fclose(f);
    dwfl_report_end(s->dwfl, NULL, NULL);
    return rc;
}

struct shim *shim_open(int pid, const char *maps, size_t len) {
    struct shim *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    elf_version(EV_CURRENT);
    s->cb.find_elf = find_elf_ro;
    s->cb.find_debuginfo = dwfl_standard_find_debuginfo;
    s->dwfl = dwfl_begin(&s->cb);
    if (!s->dwfl || shim_report(s, maps, len) != 0 || !dwfl_attach_state(s->dwfl, NULL, pid, &tcb, s)) {
        if (s->dwfl) dwfl_end(s->dwfl);
        free(s);
        return NULL;
    }
    return s;
}

Dwfl *shim_dwfl(struct shim *s) { return s->dwfl; }

/* regs: ip sp bp bx r12 r13 r14 r15 (the BPF record's order). Returns frames written to out
 * (leaf first, return addresses minus one), and *err = 1 if unwinding ended on an error. */
int shim_unwind(struct shim *s, int tid, const uint8_t *stack, size_t len, const uint64_t *r,
                uint64_t *out, int max, int *err) {
    memset(s->regs, 0, sizeof s->regs);
    s->regs[16] = r[0]; s->regs[7] = r[1]; s->regs[6] = r[2]; s->regs[3] = r[3];
    s->regs[12] = r[4]; s->regs[13] = r[5]; s->regs[14] = r[6]; s->regs[15] = r[7];
    s->tid = tid; s->stack = stack; s->len = len; s->sp = r[1];
    s->out = out; s->n = 0; s->max = max;
    int rc = dwfl_getthread_frames(s->dwfl, tid, frame_cb, s);
    *err = rc == -1;
    return s->n;
}

const char *shim_errmsg(void) { return dwfl_errmsg(-1); }

/* Inlined frames at pc (a return address minus one, or the leaf pc): writes up to max
 * (name, file, line) triples innermost first, the outermost being the real function.  Needs
 * DWARF (debuginfo); returns 0 without it. */
#include <dwarf.h>
#include <elfutils/libdw.h>
int shim_inlines(Dwfl *dwfl, uint64_t pc, const char **names, const char **files, int *lines, int max) {
    Dwfl_Module *mod = dwfl_addrmodule(dwfl, pc);
    if (!mod) return 0;
    Dwarf_Addr bias;
    Dwarf_Die *cu = dwfl_module_addrdie(mod, pc, &bias);
    if (!cu) return 0;
    Dwarf_Die *scopes = NULL;
    int ns = dwarf_getscopes(cu, pc - bias, &scopes);
    if (ns <= 0) return 0;
    Dwarf_Files *srcfiles = NULL;
    size_t nfiles = 0;
    dwarf_getsrcfiles(cu, &srcfiles, &nfiles);
    /* line of the innermost scope: the line table at pc */
    const char *file = NULL;
    int line = 0;
    Dwfl_Line *ln = dwfl_module_getsrc(mod, pc);
    if (ln) file = dwfl_lineinfo(ln, NULL, &line, NULL, NULL, NULL);
    /* innermost function-like scope; then climb the concrete DIE tree (dwarf_getscopes_die):
     * after an inlined instance, dwarf_getscopes continues in the abstract origin's tree */
    Dwarf_Die cur;
    int found = 0;
    for (int i = 0; i < ns; i++) {
        int tag = dwarf_tag(&scopes[i]);
        if (tag == DW_TAG_inlined_subroutine || tag == DW_TAG_subprogram) { cur = scopes[i]; found = 1; break; }
    }
    int n = 0;
    while (found && n < max) {
        int tag = dwarf_tag(&cur);
        Dwarf_Attribute a;
        const char *name = NULL;
        if (dwarf_attr_integrate(&cur, DW_AT_linkage_name, &a)) name = dwarf_formstring(&a);
        if (!name) name = dwarf_diename(&cur);
        names[n] = name; files[n] = file; lines[n] = line; n++;
        if (tag == DW_TAG_subprogram) break;
        Dwarf_Word fidx = 0, cl = 0;   /* the caller's position is this inlined call's call site */
        if (dwarf_formudata(dwarf_attr(&cur, DW_AT_call_file, &a), &fidx) == 0 && srcfiles)
            file = dwarf_filesrc(srcfiles, fidx, NULL, NULL);
        if (dwarf_formudata(dwarf_attr(&cur, DW_AT_call_line, &a), &cl) == 0) line = (int)cl;
        Dwarf_Die *up = NULL;
        int nu = dwarf_getscopes_die(&cur, &up);
        found = 0;
        for (int i = 1; i < nu; i++) {
            int t = dwarf_tag(&up[i]);
            if (t == DW_TAG_inlined_subroutine || t == DW_TAG_subprogram) { cur = up[i]; found = 1; break; }
        }
        free(up);
    }
    free(scopes);
    return n;
}
