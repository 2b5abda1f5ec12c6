#!/bin/sh
# Build the prototype's workloads and the libdwfl helper (Debian: gcc g++ libdw-dev).
set -e
cd "$(dirname "$0")"
gcc -O2 -fomit-frame-pointer -g -shared -fPIC -o libchain.so libchain.c
gcc -O2 -fomit-frame-pointer -g -o chain chain.c -L. -lchain -Wl,-rpath,'$ORIGIN'
gcc -O2 -fomit-frame-pointer -fno-builtin -g -o storm storm.c
g++ -O2 -fomit-frame-pointer -g -pthread -o cxxthreads cxxthreads.cpp
gcc -O2 -Wall -shared -fPIC -o libshim.so shim.c -ldw -lelf
protoc --python_out=. profile.proto
gcc -O2 -fomit-frame-pointer -g -o inl inl.c
