/* lossplot.c: loss.svg, the run directory's static picture of the training
 * and validation loss against the step (docs/run-dir.md), drawn without any
 * library: a few lines of SVG text. The trainer calls it after each
 * evaluation; the dashboard draws its own live chart. */
#include <math.h>
#include <stdlib.h>

#include "train/tinternal.h"

int tplot_loss_svg(const char *path, const int64_t *hs, const double *hl, size_t nh, const int64_t *he,
                   const double *hv, size_t ne, k3_err *err) {
    const double W = 720, H = 400, L = 60, R = 20, Tp = 30, Bt = 40;
    double lo = INFINITY, hi = -INFINITY;
    int64_t smax = 1;
    for (size_t i = 0; i < nh; i++) {
        if (isfinite(hl[i])) { lo = fmin(lo, hl[i]); hi = fmax(hi, hl[i]); }
        if (hs[i] > smax) smax = hs[i];
    }
    for (size_t i = 0; i < ne; i++) {
        if (isfinite(hv[i])) { lo = fmin(lo, hv[i]); hi = fmax(hi, hv[i]); }
        if (he[i] > smax) smax = he[i];
    }
    if (!isfinite(lo)) { lo = 0; hi = 1; }
    if (hi - lo < 1e-6) hi = lo + 1;
    k3_sbuf sb = {0};
#define PR(...) k3_sb_printf(&sb, __VA_ARGS__)
    PR("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" viewBox=\"0 0 %g %g\">\n", W, H, W, H);
    PR("<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    PR("<text x=\"%g\" y=\"20\" font-family=\"sans-serif\" font-size=\"14\">loss (nats/token) vs step: "
       "<tspan fill=\"#1f77b4\">train</tspan> <tspan fill=\"#d62728\">validation</tspan></text>\n", L);
    PR("<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"#888\"/>\n", L, Tp, W - L - R,
       H - Tp - Bt);
    for (int k = 0; k <= 4; k++) {
        double v = lo + (hi - lo) * k / 4, y = H - Bt - (H - Tp - Bt) * k / 4;
        PR("<text x=\"%g\" y=\"%g\" font-family=\"sans-serif\" font-size=\"11\" text-anchor=\"end\">%.3f</text>\n",
           L - 4, y + 4, v);
        double s = (double)smax * k / 4, x = L + (W - L - R) * k / 4;
        PR("<text x=\"%g\" y=\"%g\" font-family=\"sans-serif\" font-size=\"11\" text-anchor=\"middle\">%.0f</text>\n",
           x, H - Bt + 16, s);
    }
    for (int pass = 0; pass < 2; pass++) {
        size_t cnt = pass ? ne : nh;
        if (!cnt) continue;
        PR("<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" points=\"", pass ? "#d62728" : "#1f77b4",
           pass ? "2" : "1");
        for (size_t i = 0; i < cnt; i++) {
            double v = pass ? hv[i] : hl[i];
            int64_t st = pass ? he[i] : hs[i];
            if (!isfinite(v)) continue;
            double x = L + (W - L - R) * (double)st / (double)smax;
            double y = H - Bt - (H - Tp - Bt) * (v - lo) / (hi - lo);
            PR("%.1f,%.1f ", x, y);
        }
        PR("\"/>\n");
    }
    PR("</svg>\n");
#undef PR
    int rc = k3_write_file_atomic(path, sb.p ? sb.p : "", sb.n, err);
    k3_sb_free(&sb);
    return rc;
}

/* ---- the run's history ------------------------------------------------------------- */

/* The losses loss.svg shows, kept by the run as they come (and rebuilt from
 * metrics.jsonl on --resume); only the writer draws. */
int tplot_write_svg(trun *r, k3_err *err) {
    if (!r->writer) return K3_OK;
    char *p = trun_path(r, "loss.svg");
    int rc = tplot_loss_svg(p, r->hs, r->hl, r->nh, r->he, r->hv, r->ne, err);
    free(p);
    return rc;
}

void tplot_add_train(trun *r, int64_t step, double loss) {
    if (r->nh == r->caph) {
        r->caph = r->caph ? r->caph * 2 : 1024;
        r->hs = xrealloc_array(r->hs, r->caph, sizeof(int64_t));
        r->hl = xrealloc_array(r->hl, r->caph, sizeof(double));
    }
    r->hs[r->nh] = step;
    r->hl[r->nh++] = loss;
}

void tplot_add_eval(trun *r, int64_t step, double loss) {
    if (r->ne == r->cape) {
        r->cape = r->cape ? r->cape * 2 : 256;
        r->he = xrealloc_array(r->he, r->cape, sizeof(int64_t));
        r->hv = xrealloc_array(r->hv, r->cape, sizeof(double));
    }
    r->he[r->ne] = step;
    r->hv[r->ne++] = loss;
}
