/* A library that passes every check made by reading its file (a shared object exporting one
 * `dflash_plugin_*` symbol) but is no plugin: its constructor records the pid of each process
 * that loads it (to the file $DFLASH_EVIL_MARKER), and its entry symbol holds bytes that, read
 * as the pointer to a root-module header, point nowhere. A host must never load it into its
 * own process, and loading it elsewhere crashes. Built by tests/plugins_so.rs with `cc`. */
#include <stdio.h>
#include <stdlib.h>
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
}

__attribute__((visibility("default"))) const unsigned char dflash_plugin_evil[64] = {[0 ... 63] = 0x41};
