/* The floor for codec speed: YAJL parsing every line of a file, no callbacks.
 *
 *     rawyajl FILE            one handle per line (what a line-oriented service must do)
 *     rawyajl --stream FILE   one handle for the whole file (yajl_allow_multiple_values)
 */
#include <yajl/yajl_parse.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    int stream = argc == 3 && strcmp(argv[1], "--stream") == 0;
    const char *path = argv[argc - 1];
    FILE *file = fopen(path, "rb");
    if (!file) { perror(path); return 2; }
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    unsigned char *bytes = malloc(size);
    if (fread(bytes, 1, size, file) != (size_t)size) return 2;
    long lines = 0, bad = 0;
    if (stream) {
        yajl_handle handle = yajl_alloc(NULL, NULL, NULL);
        yajl_config(handle, yajl_allow_multiple_values, 1);
        if (yajl_parse(handle, bytes, size) != yajl_status_ok || yajl_complete_parse(handle) != yajl_status_ok) bad++;
        yajl_free(handle);
        for (long i = 0; i < size; i++) lines += bytes[i] == '\n';
    } else {
        unsigned char *p = bytes, *end = bytes + size;
        while (p < end) {
            unsigned char *newline = memchr(p, '\n', end - p);
            if (!newline) newline = end;
            yajl_handle handle = yajl_alloc(NULL, NULL, NULL);
            if (yajl_parse(handle, p, newline - p) != yajl_status_ok || yajl_complete_parse(handle) != yajl_status_ok) bad++;
            yajl_free(handle);
            lines++;
            p = newline + 1;
        }
    }
    printf("%ld lines, %ld not JSON\n", lines, bad);
    return 0;
}
