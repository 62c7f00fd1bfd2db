/* A library that passes every check made by reading its file (a shared object exporting one
 * `dflash_plugin_*` symbol that starts with abi_stable's header: its magic string and ABI
 * version) but is no plugin: past the header its bytes, read as the pointers of a root-module
 * header, point nowhere, so loading it crashes. Its constructor records the pid of each process
 * that loads it (to the file $DFLASH_EVIL_MARKER), and does what $DFLASH_EVIL_MODE says:
 * `kill` signals its process group and its parent with SIGKILL, `flood` writes 1.5 GB to stdout.
 * A host must never load it into its own process, and must survive a probe that does.
 * Built by tests/plugins_so.rs with `cc`. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((constructor)) static void record_loader(void) {
    const char *marker = getenv("DFLASH_EVIL_MARKER");
    if (marker) {
        FILE *f = fopen(marker, "a");
        if (f) {
            fprintf(f, "%d\n", (int)getpid());
            fclose(f);
        }
    }
    const char *mode = getenv("DFLASH_EVIL_MODE");
    if (mode && strcmp(mode, "kill") == 0) {
        kill(0, SIGKILL);
        kill(getppid(), SIGKILL);
        kill(getpid(), SIGKILL);
    } else if (mode && strcmp(mode, "flood") == 0) {
        static char block[1 << 20];
        memset(block, 'x', sizeof block);
        for (int i = 0; i < 1536; i++) {
            if (write(1, block, sizeof block) < 0) break;
        }
    }
}

struct header {
    char magic[32];
    unsigned int abi_major, abi_minor;
    unsigned char rest[64];
};

__attribute__((visibility("default"))) const struct header dflash_plugin_evil = {
    "abi stable library for Rust     ", 0, 11, {[0 ... 63] = 0x41}};
