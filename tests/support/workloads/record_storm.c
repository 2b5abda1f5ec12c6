/* Single-thread malloc storm for the record tests: N malloc+free pairs of SIZE bytes;
 * prints "pairs N ns_per_pair X". usage: record_storm N [SIZE]
 * `record_storm stdin` is bench/storm.c's interactive storm instead: it prints "ready PID", then
 * runs one storm per "N SIZE" line read from stdin, so a test decides when each part happens.
 * It is bench/storm.c's storms (the ones bench/record_bench.py measures), not a copy. */
#define main storm_main
#include "../../../bench/storm.c"
#undef main

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "stdin")) return storm();
    return once(argc - 1, argv + 1);
}
