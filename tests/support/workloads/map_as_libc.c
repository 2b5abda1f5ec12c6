/* Workload for tests/live/test_top_libcs.py: a process of an unprivileged user that maps a
 * file of its choosing named libc.so.6 (not an ELF file, or a truncated one) readable and
 * executable, so that pymtrace takes it for this process's libc. argv[1]: the file.
 * Prints "ready PID" once mapped; exits when stdin is closed. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    int fd = open(argv[1], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) return 3;
    /* below everything else (first in /proc/PID/maps): taken before the real libc */
    void *p = mmap((void *)0x200000000UL, st.st_size, PROT_READ | PROT_EXEC,
                   MAP_PRIVATE | MAP_FIXED_NOREPLACE, fd, 0);
    if (p == MAP_FAILED) return 4;
    char line[64];
    int n = snprintf(line, sizeof(line), "ready %d\n", (int)getpid());
    if (write(1, line, n) != n) return 5;
    char c;
    while (read(0, &c, 1) > 0)
        ;
    return 0;
}
