/*
 * main.c: entry point of kvfence-node, the kvfence per-host data-plane worker (transfers arrive
 * with the node issue).
 *
 * Until its services exist this binary answers --version and --help only, so
 * that the README's run command has something true to run.
 */
#include <stdio.h>
#include <string.h>

#include "kvf_version.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: kvfence-node [--version] [--help]\n");
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--version") == 0) {
            printf("kvfence-node %s (cuda %s)\n", KVF_VERSION_STRING,
                   KVF_HAVE_CUDA_BUILD ? "yes" : "no");
            return 0;
        }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return 0;
        }
        fprintf(stderr, "kvfence-node: unknown argument '%s'\n", argv[i]);
        usage(stderr);
        return 2;
    }
    usage(stderr);
    return 2;
}
