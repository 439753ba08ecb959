/* assets.h: the web pages embedded in the binary (no files, no network): the
 * dashboard's (k3 dashboard) and the chat page (k3 serve, src/web/assets/chat/).
 *
 * The bytes come from src/web/assets/ at build time: the Makefile runs
 * scripts/embed-web-assets.sh, which writes build/gen/web_assets.c with one
 * entry per file, so the binary always serves exactly the files in the tree
 * (the dashboard CLI test compares them byte for byte). */
#ifndef K3_WEB_ASSETS_H
#define K3_WEB_ASSETS_H

#include <stddef.h>

typedef struct {
    const char *path, *type;   /* URL path, Content-Type */
    const unsigned char *data;
    size_t len;
} k3_web_asset;

extern const k3_web_asset k3_web_assets[];
extern const size_t k3_web_nassets;
extern const k3_web_asset k3_serve_assets[];
extern const size_t k3_serve_nassets;

#endif
