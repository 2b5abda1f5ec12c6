/* Single-thread malloc storm for tests/live/test_record.py: N malloc+free pairs of SIZE bytes;
 * prints "pairs N ns_per_pair X". usage: record_storm N [SIZE]
 * It is bench/storm.c's `once` storm (the one bench/record_bench.py measures), not a copy. */
#define main storm_main
#include "../../../bench/storm.c"
#undef main

int main(int argc, char **argv) {
    return once(argc - 1, argv + 1);
}
