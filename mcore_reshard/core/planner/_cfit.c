/* First fit under a per-rank staging budget, in C: the planner's one sequential hot loop.
 *
 * The reference is the Python of ``rounds.RoundFill`` / ``placement._fit``; this kernel gives the
 * same rounds item for item (tests/core/planner/test_planner_cfit.py compares the two on random inputs and on
 * full-size plans by hash).  Everything here is pure computation on ints: no Python object is
 * kept, nothing touches torch.  Any input outside the ranges below raises ValueError /
 * OverflowError before anything is placed, and the caller plans with the Python code instead.
 *
 * First fit: an item of n bytes from rank s to rank d goes to the lowest round k where both
 * used[k][s] + n <= budget and used[k][d] + n <= budget (rounds past the end are empty); a run of
 * equal items goes there as many at once as fit, then on to the next such round (lower rounds
 * never regain room, so one at a time lands the same).  Per (rank, size level) a pointer below
 * which no round has room for that size (usage only grows: a pointer stays right), so a search
 * starts at the larger of the two ranks' pointers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CFIT_VERSION 1

typedef struct {
    int64_t budget;
    Py_ssize_t nranks;      /* dense rank indices 0 .. nranks-1 */
    Py_ssize_t nlevels;
    Py_ssize_t cap;         /* rounds allocated (rank-major arrays: [r * cap + k], a rank's rounds
                               contiguous for the scans) */
    Py_ssize_t rounds;      /* 1 + the highest round anything landed in */
    int64_t *used;          /* staged bytes per (rank, round) */
    int64_t *sent;          /* of which sent (NULL: not counted) */
    int32_t *ptr;           /* [r * nlevels + lv]: no round below has room for level lv on r */
} Fill;

/* Limits: a plan of more rounds, or a fill of more bytes, is left to the Python (the caller falls
 * back on OverflowError / MemoryError): full-size plans need ~2 k rounds and ~16 MiB here. */
#define MAX_ROUNDS ((Py_ssize_t)1 << 21)
#define MAX_FILL_BYTES ((size_t)1 << 31)

static int grow(Fill *f, Py_ssize_t need) {
    Py_ssize_t cap = f->cap ? f->cap : 16;
    if (need > MAX_ROUNDS) {
        PyErr_SetString(PyExc_OverflowError, "first fit: more than 2**21 rounds");
        return -1;
    }
    while (cap < need) cap *= 2;
    if (cap == f->cap) return 0;
    if ((size_t)cap > MAX_FILL_BYTES / sizeof(int64_t) / 2 / (size_t)f->nranks) {
        PyErr_Format(PyExc_MemoryError, "first fit: %zd ranks x %zd rounds is more than the kernel keeps", f->nranks, cap);
        return -1;
    }
    int64_t **arrays[2] = {&f->used, &f->sent};
    for (int i = 0; i < 2; i++) {
        if (i == 1 && !f->sent) break;
        int64_t *now = calloc((size_t)cap * (size_t)f->nranks, sizeof(int64_t));
        if (!now) { PyErr_NoMemory(); return -1; }
        if (f->cap)
            for (Py_ssize_t r = 0; r < f->nranks; r++)
                memcpy(now + r * cap, *arrays[i] + r * f->cap, (size_t)f->cap * sizeof(int64_t));
        free(*arrays[i]);
        *arrays[i] = now;
    }
    f->cap = cap;
    return 0;
}

static int fill_init(Fill *f, int64_t budget, Py_ssize_t nranks, Py_ssize_t nlevels, int count_sent) {
    memset(f, 0, sizeof(*f));
    f->budget = budget;
    f->nranks = nranks > 0 ? nranks : 1;
    f->nlevels = nlevels > 0 ? nlevels : 1;
    if ((size_t)f->nranks > SIZE_MAX / sizeof(int32_t) / (size_t)f->nlevels) {
        PyErr_NoMemory();
        return -1;
    }
    f->ptr = calloc((size_t)f->nranks * (size_t)f->nlevels, sizeof(int32_t));
    if (!f->ptr) { PyErr_NoMemory(); return -1; }
    if (count_sent) {
        f->sent = calloc(1, sizeof(int64_t));  /* grown with used */
        if (!f->sent) { PyErr_NoMemory(); return -1; }
    }
    return grow(f, 16);
}

static void fill_free(Fill *f) {
    free(f->used);
    free(f->sent);
    free(f->ptr);
    memset(f, 0, sizeof(*f));
}

/* Up to ``want`` items of ``n`` bytes (level ``lv``) from s to d into the lowest round where
 * both have room: returns that round and sets *got to how many went there; -1 when that round
 * would be >= ``stop`` (nothing placed), -2 on an error (set). */
static Py_ssize_t fill_one(Fill *f, Py_ssize_t s, Py_ssize_t d, Py_ssize_t lv, int64_t n, int64_t want,
                           int64_t stop, int64_t *got) {
    const int64_t lim = f->budget - n;
    const Py_ssize_t cap = f->cap;
    const int64_t *us = f->used + s * cap, *ud = f->used + d * cap;
    int32_t *ps = &f->ptr[s * f->nlevels + lv], *pd = &f->ptr[d * f->nlevels + lv];
    Py_ssize_t k = *ps, k2 = *pd;
    while (k < cap && us[k] > lim) k++;
    *ps = (int32_t)k;
    while (k2 < cap && ud[k2] > lim) k2++;
    *pd = (int32_t)k2;
    if (k2 > k) k = k2;
    while (k < cap && (us[k] > lim || ud[k] > lim)) k++;
    if (k >= stop) return -1;
    if (k >= cap && grow(f, k + 1) < 0) return -2;
    int64_t *ws = f->used + s * f->cap + k, *wd = f->used + d * f->cap + k;
    int64_t a = *ws, b = *wd;
    int64_t c = (f->budget - (a > b ? a : b)) / n;
    if (c > want) c = want;
    *ws = a + c * n;
    if (d != s) *wd = b + c * n;    /* as the Python: both read before either is written */
    if (f->sent) f->sent[s * f->cap + k] += c * n;
    if (k + 1 > f->rounds) f->rounds = k + 1;
    *got = c;
    return k;
}

/* ------------------------------------------------------------------ helpers */

/* ``seq`` (a list or tuple of ints) into a new int64 array of its length (*len). */
static int64_t *as_int64s(PyObject *seq, Py_ssize_t *len, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int64_t *out = malloc((n ? n : 1) * sizeof(int64_t));
    if (!out) { Py_DECREF(fast); PyErr_NoMemory(); return NULL; }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) { free(out); Py_DECREF(fast); return NULL; }
        out[i] = (int64_t)v;
    }
    Py_DECREF(fast);
    *len = n;
    return out;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Dense indices of ranks 0 <= r < 2**24: *map (max + 1 entries, -1: absent), *nranks. */
static int32_t *dense_map(const int64_t *ranks, Py_ssize_t n, Py_ssize_t *size, Py_ssize_t *nranks) {
    int64_t top = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ranks[i] < 0 || ranks[i] >= ((int64_t)1 << 24)) {
            PyErr_Format(PyExc_OverflowError, "first fit: rank %lld outside [0, 2**24)", (long long)ranks[i]);
            return NULL;
        }
        if (ranks[i] > top) top = ranks[i];
    }
    int32_t *map = malloc((size_t)(top + 2) * sizeof(int32_t));
    if (!map) { PyErr_NoMemory(); return NULL; }
    for (int64_t r = 0; r <= top; r++) map[r] = -1;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (map[ranks[i]] < 0) map[ranks[i]] = -2;
    for (int64_t r = 0; r <= top; r++)
        if (map[r] == -2) map[r] = (int32_t)k++;
    *size = (Py_ssize_t)(top + 1);
    *nranks = k;
    return map;
}

/* ------------------------------------------------------------------ fit_runs */

PyDoc_STRVAR(fit_runs_doc,
"fit_runs(src, dst, nbytes, count, budget) -> (rounds, chunk_rounds, chunk_counts)\n\n"
"Runs of equal items (run i: count[i] items of nbytes[i] bytes, 0 < nbytes <= budget, from rank\n"
"src[i] to rank dst[i]), first fit in the order given; per run its chunks in order (a round and\n"
"how many of the run's items went there), flat over all runs.");

/* Runs (run i: cnt[i] items of nb[i] bytes, 0 < nb <= budget, from rank s[i] to rank d[i], ranks
 * in [0, 2**24)) first fit in order: *chunks chunks, per run in order (round ck[c], how many cc[c]),
 * *rounds the rounds used.  The arrays ck, cc are allocated here (the caller frees them).
 * Returns 0, or -1 with an error set. */
static int fit_run_arrays(const int64_t *s, const int64_t *d, const int64_t *nb, const int64_t *cnt, Py_ssize_t ns,
                          int64_t budget, int64_t **ck_out, int64_t **cc_out, Py_ssize_t *chunks_out,
                          Py_ssize_t *rounds) {
    int64_t *sizes = NULL, *all = NULL, *ck = NULL, *cc = NULL;
    int32_t *map = NULL, *lvl = NULL;
    int status = -1;
    Fill f;
    memset(&f, 0, sizeof(f));
    if (budget <= 0) { PyErr_SetString(PyExc_ValueError, "fit_runs: budget must be positive"); goto done; }
    for (Py_ssize_t i = 0; i < ns; i++)
        if (nb[i] <= 0 || nb[i] > budget || cnt[i] < 0) {
            PyErr_Format(PyExc_ValueError, "fit_runs: run %zd has %lld bytes x %lld (budget %lld)", i,
                         (long long)nb[i], (long long)cnt[i], (long long)budget);
            goto done;
        }
    /* dense ranks */
    all = malloc((size_t)(2 * ns + 1) * sizeof(int64_t));
    if (!all) { PyErr_NoMemory(); goto done; }
    memcpy(all, s, ns * sizeof(int64_t));
    memcpy(all + ns, d, ns * sizeof(int64_t));
    Py_ssize_t msize, nranks;
    if (!(map = dense_map(all, 2 * ns, &msize, &nranks))) goto done;
    /* levels: distinct sizes */
    sizes = malloc((size_t)(ns + 1) * sizeof(int64_t));
    lvl = malloc((size_t)(ns + 1) * sizeof(int32_t));
    if (!sizes || !lvl) { PyErr_NoMemory(); goto done; }
    memcpy(sizes, nb, ns * sizeof(int64_t));
    qsort(sizes, ns, sizeof(int64_t), cmp_i64);
    Py_ssize_t nl = 0;
    for (Py_ssize_t i = 0; i < ns; i++)
        if (nl == 0 || sizes[nl - 1] != sizes[i]) sizes[nl++] = sizes[i];
    for (Py_ssize_t i = 0; i < ns; i++) {
        Py_ssize_t lo = 0, hi = nl;
        while (lo < hi) { Py_ssize_t m = (lo + hi) / 2; if (sizes[m] < nb[i]) lo = m + 1; else hi = m; }
        lvl[i] = (int32_t)lo;
    }
    if (fill_init(&f, budget, nranks, nl, 0) < 0) goto done;
    Py_ssize_t chunks = 0, ccap = ns + 16;
    ck = malloc(ccap * sizeof(int64_t));
    cc = malloc(ccap * sizeof(int64_t));
    if (!ck || !cc) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < ns; i++) {
        int64_t left = cnt[i];
        Py_ssize_t a = map[s[i]], b = map[d[i]];
        while (left > 0) {
            int64_t got;
            Py_ssize_t k = fill_one(&f, a, b, lvl[i], nb[i], left, INT64_MAX, &got);
            if (k < 0) goto done;
            if (chunks == ccap) {
                ccap *= 2;
                int64_t *x = realloc(ck, ccap * sizeof(int64_t)), *y;
                if (!x) { PyErr_NoMemory(); goto done; }
                ck = x;
                y = realloc(cc, ccap * sizeof(int64_t));
                if (!y) { PyErr_NoMemory(); goto done; }
                cc = y;
            }
            ck[chunks] = k;
            cc[chunks] = got;
            chunks++;
            left -= got;
        }
    }
    *ck_out = ck;
    *cc_out = cc;
    ck = cc = NULL;
    *chunks_out = chunks;
    *rounds = f.rounds;
    status = 0;
done:
    free(sizes); free(all); free(map); free(lvl); free(ck); free(cc);
    fill_free(&f);
    return status;
}

static PyObject *fit_runs(PyObject *self, PyObject *args) {
    PyObject *os, *od, *on, *oc;
    long long budget;
    if (!PyArg_ParseTuple(args, "OOOOL", &os, &od, &on, &oc, &budget)) return NULL;
    Py_ssize_t ns, nd, nn, nc, chunks, rounds;
    int64_t *s = NULL, *d = NULL, *nb = NULL, *cnt = NULL, *ck = NULL, *cc = NULL;
    PyObject *result = NULL;
    if (!(s = as_int64s(os, &ns, "src")) || !(d = as_int64s(od, &nd, "dst")) || !(nb = as_int64s(on, &nn, "nbytes"))
        || !(cnt = as_int64s(oc, &nc, "count")))
        goto done;
    if (nd != ns || nn != ns || nc != ns) {
        PyErr_SetString(PyExc_ValueError, "fit_runs: src, dst, nbytes and count differ in length");
        goto done;
    }
    if (fit_run_arrays(s, d, nb, cnt, ns, budget, &ck, &cc, &chunks, &rounds) < 0) goto done;
    PyObject *lk = PyList_New(chunks), *lc = PyList_New(chunks);
    if (!lk || !lc) { Py_XDECREF(lk); Py_XDECREF(lc); goto done; }
    for (Py_ssize_t i = 0; i < chunks; i++) {
        PyObject *x = PyLong_FromLongLong(ck[i]), *y = PyLong_FromLongLong(cc[i]);
        if (!x || !y) { Py_XDECREF(x); Py_XDECREF(y); Py_DECREF(lk); Py_DECREF(lc); goto done; }
        PyList_SET_ITEM(lk, i, x);
        PyList_SET_ITEM(lc, i, y);
    }
    result = Py_BuildValue("nNN", rounds, lk, lc);
done:
    free(s); free(d); free(nb); free(cnt); free(ck); free(cc);
    return result;
}

/* ------------------------------------------------------------------ fit_copies */

typedef struct { int64_t c0, s, d; Py_ssize_t i; } CopyKey;         /* (-bytes, src, dst, position) */
typedef struct { int64_t k, s, d; Py_ssize_t start, n, i; } Chunk;  /* a run's items [start, start + n) */

static int cmp_copy(const void *a, const void *b) {
    const CopyKey *x = a, *y = b;
    if (x->c0 != y->c0) return x->c0 < y->c0 ? -1 : 1;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    if (x->d != y->d) return x->d < y->d ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

static int cmp_chunk(const void *a, const void *b) {
    const Chunk *x = a, *y = b;
    if (x->k != y->k) return x->k < y->k ? -1 : 1;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    if (x->d != y->d) return x->d < y->d ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

PyDoc_STRVAR(fit_copies_doc,
"fit_copies(copies, budget, align) -> (rounds, keys, groups)\n\n"
"rounds._first_fit_runs on copy tuples (-bytes, src, dst, ...): stably sorted by (-bytes, src, dst),\n"
"runs of equal ones first fit (each align-rounded bytes, at most budget); ``keys`` the (round, src,\n"
"dst) with copies, sorted, and ``groups`` their copies (the tuples given, by run, then in order).");

static PyObject *fit_copies(PyObject *self, PyObject *args) {
    PyObject *ocopies;
    long long budget, align;
    if (!PyArg_ParseTuple(args, "OLL", &ocopies, &budget, &align)) return NULL;
    PyObject *result = NULL, *fast = NULL, *keys = NULL, *groups = NULL;
    CopyKey *ord = NULL;
    Chunk *ch = NULL;
    int64_t *s = NULL, *d = NULL, *nb = NULL, *cnt = NULL, *ck = NULL, *cc = NULL;
    Py_ssize_t *start = NULL;
    if (align <= 0) { PyErr_SetString(PyExc_ValueError, "fit_copies: align must be positive"); return NULL; }
    if (!(fast = PySequence_Fast(ocopies, "copies"))) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    ord = malloc((n + 1) * sizeof(CopyKey));
    if (!ord) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = items[i];
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) < 3) {
            PyErr_Format(PyExc_ValueError, "fit_copies: copy %zd is not a tuple of (-bytes, src, dst, ...)", i);
            goto done;
        }
        long long v[3];
        for (int f = 0; f < 3; f++) {
            v[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(c, f));
            if (v[f] == -1 && PyErr_Occurred()) goto done;
        }
        if (v[0] >= 0 || v[0] < -budget) {
            PyErr_Format(PyExc_ValueError, "fit_copies: copy %zd has %lld bytes (budget %lld)", i, -v[0], budget);
            goto done;
        }
        ord[i].c0 = v[0];
        ord[i].s = v[1];
        ord[i].d = v[2];
        ord[i].i = i;
    }
    qsort(ord, n, sizeof(CopyKey), cmp_copy);       /* stable: ties by position */
    /* runs */
    Py_ssize_t nr = 0;
    s = malloc((n + 1) * sizeof(int64_t)); d = malloc((n + 1) * sizeof(int64_t));
    nb = malloc((n + 1) * sizeof(int64_t)); cnt = malloc((n + 1) * sizeof(int64_t));
    start = malloc((n + 1) * sizeof(Py_ssize_t));
    if (!s || !d || !nb || !cnt || !start) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (nr && ord[i].c0 == ord[i - 1].c0 && ord[i].s == ord[i - 1].s && ord[i].d == ord[i - 1].d) {
            cnt[nr - 1]++;
            continue;
        }
        int64_t bytes = -ord[i].c0;
        s[nr] = ord[i].s;
        d[nr] = ord[i].d;
        nb[nr] = (bytes + align - 1) / align * align;
        cnt[nr] = 1;
        start[nr] = i;
        nr++;
    }
    Py_ssize_t chunks, rounds;
    if (fit_run_arrays(s, d, nb, cnt, nr, budget, &ck, &cc, &chunks, &rounds) < 0) goto done;
    ch = malloc((chunks + 1) * sizeof(Chunk));
    if (!ch) { PyErr_NoMemory(); goto done; }
    Py_ssize_t c = 0;
    for (Py_ssize_t r = 0; r < nr; r++) {
        Py_ssize_t at = start[r], left = cnt[r];
        while (left > 0) {
            ch[c].k = ck[c]; ch[c].s = s[r]; ch[c].d = d[r]; ch[c].start = at; ch[c].n = cc[c]; ch[c].i = c;
            at += cc[c];
            left -= cc[c];
            c++;
        }
    }
    qsort(ch, chunks, sizeof(Chunk), cmp_chunk);
    Py_ssize_t ngroups = 0;
    for (Py_ssize_t x = 0; x < chunks; x++)
        if (!x || ch[x].k != ch[x - 1].k || ch[x].s != ch[x - 1].s || ch[x].d != ch[x - 1].d) ngroups++;
    if (!(keys = PyList_New(ngroups)) || !(groups = PyList_New(ngroups))) goto done;
    Py_ssize_t g = 0, x = 0;
    while (x < chunks) {
        Py_ssize_t end = x + 1, total = ch[x].n;
        while (end < chunks && ch[end].k == ch[x].k && ch[end].s == ch[x].s && ch[end].d == ch[x].d)
            total += ch[end++].n;
        PyObject *key = Py_BuildValue("(LLL)", (long long)ch[x].k, (long long)ch[x].s, (long long)ch[x].d);
        PyObject *list = PyList_New(total);
        if (!key || !list) { Py_XDECREF(key); Py_XDECREF(list); goto done; }
        Py_ssize_t y = 0;
        for (Py_ssize_t z = x; z < end; z++)
            for (Py_ssize_t q = ch[z].start; q < ch[z].start + ch[z].n; q++) {
                PyObject *o = items[ord[q].i];
                Py_INCREF(o);
                PyList_SET_ITEM(list, y++, o);
            }
        PyList_SET_ITEM(keys, g, key);
        PyList_SET_ITEM(groups, g, list);
        g++;
        x = end;
    }
    result = Py_BuildValue("nOO", rounds, keys, groups);
done:
    Py_XDECREF(keys);
    Py_XDECREF(groups);
    Py_XDECREF(fast);
    free(ord); free(ch); free(s); free(d); free(nb); free(cnt); free(start); free(ck); free(cc);
    return result;
}

/* ------------------------------------------------------------------ entries */

PyDoc_STRVAR(entries_doc,
"entries(group, src, dst, cls, align) -> (entries, nbytes, payload)\n\n"
"A message's entries from its copy tuples (-bytes, src, dst, tensor, offsets, sizes, seq, src buffer,\n"
"src local Box, dst buffer, dst local offsets, dst local sizes, Box, dst local Box), in order: each\n"
"cls(tensor, Box, src, src buffer, src local Box, dst, dst buffer, dst local Box, bytes, offset)\n"
"(cls a 10-field tuple type: plan.Copy), offsets aligned to ``align``; the message's bytes (the\n"
"last offset past its entry) and payload (the bytes without alignment).");

static PyObject *entries(PyObject *self, PyObject *args) {
    PyObject *ogroup, *src, *dst, *cls;
    long long align;
    if (!PyArg_ParseTuple(args, "OOOOL", &ogroup, &src, &dst, &cls, &align)) return NULL;
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type) || align <= 0) {
        PyErr_SetString(PyExc_ValueError, "entries: cls must be a tuple type and align positive");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(ogroup, "group");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyTuple_New(n);
    long long off = 0, payload = 0;
    if (!out) goto fail;
    PyTypeObject *tp = (PyTypeObject *)cls;
    static const int take[8] = {3, 12, -1, 7, 8, -2, 9, 13};     /* copy fields; -1: src, -2: dst */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = items[i];
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) < 14) {
            PyErr_Format(PyExc_ValueError, "entries: copy %zd is not a 14-field tuple", i);
            goto fail;
        }
        long long nb = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 0));
        if (nb == -1 && PyErr_Occurred()) goto fail;
        nb = -nb;
        if (nb < 0) { PyErr_Format(PyExc_ValueError, "entries: copy %zd has %lld bytes", i, nb); goto fail; }
        PyObject *e = tp->tp_alloc(tp, 10);
        if (!e) goto fail;
        for (int f = 0; f < 8; f++) {
            PyObject *v = take[f] == -1 ? src : take[f] == -2 ? dst : PyTuple_GET_ITEM(c, take[f]);
            Py_INCREF(v);
            PyTuple_SET_ITEM(e, f, v);
        }
        PyObject *vb = PyLong_FromLongLong(nb), *vo = PyLong_FromLongLong(off);
        if (!vb || !vo) { Py_XDECREF(vb); Py_XDECREF(vo); Py_DECREF(e); goto fail; }
        PyTuple_SET_ITEM(e, 8, vb);
        PyTuple_SET_ITEM(e, 9, vo);
        PyTuple_SET_ITEM(out, i, e);
        off += (nb + align - 1) / align * align;
        payload += nb;
    }
    Py_DECREF(fast);
    return Py_BuildValue("NLL", out, off, payload);
fail:
    Py_XDECREF(out);
    Py_DECREF(fast);
    return NULL;
}

/* ------------------------------------------------------------------ place (templated) */

typedef struct {            /* one template: its messages' (src index, dst index, level, round) */
    Py_ssize_t n;
    int64_t *s, *d, *lv, *k;
    int64_t rounds;
} Tpl;

typedef unsigned __int128 u128;

static int bitlen(int64_t v) {      /* bits to hold 0 .. v - 1 (at least 1) */
    int b = 1;
    while (b < 62 && ((int64_t)1 << b) < v) b++;
    return b;
}

#define RADIX_BITS 16
#define RADIX_SIZE (1 << RADIX_BITS)

/* Stable LSD radix sorts of n keys by their bits [lo, bits), RADIX_BITS a pass (keys equal there
 * keep their order); a pass that all keys share is skipped. */
#define RADIX_SORT(name, T)                                                                     \
static int name(T *a, Py_ssize_t n, int lo, int bits) {                                         \
    if (n < 2) return 0;                                                                        \
    T *tmp = malloc((size_t)n * sizeof(T)), *src = a, *dst = tmp;                               \
    size_t *count = malloc(RADIX_SIZE * sizeof(size_t));                                        \
    if (!tmp || !count) { free(tmp); free(count); PyErr_NoMemory(); return -1; }                \
    for (int shift = lo; shift < bits; shift += RADIX_BITS) {                                   \
        memset(count, 0, RADIX_SIZE * sizeof(size_t));                                          \
        for (Py_ssize_t i = 0; i < n; i++) count[(size_t)(src[i] >> shift) & (RADIX_SIZE - 1)]++; \
        if (count[(size_t)(src[0] >> shift) & (RADIX_SIZE - 1)] == (size_t)n) continue;         \
        size_t sum = 0;                                                                         \
        for (int v = 0; v < RADIX_SIZE; v++) { size_t c = count[v]; count[v] = sum; sum += c; } \
        for (Py_ssize_t i = 0; i < n; i++) dst[count[(size_t)(src[i] >> shift) & (RADIX_SIZE - 1)]++] = src[i]; \
        T *x = src; src = dst; dst = x;                                                         \
    }                                                                                           \
    if (src != a) memcpy(a, src, (size_t)n * sizeof(T));                                        \
    free(tmp);                                                                                  \
    free(count);                                                                                \
    return 0;                                                                                   \
}

RADIX_SORT(radix128, u128)
RADIX_SORT(radix64, uint64_t)

/* What placing the items of the templated placement needs (see place()). */
typedef struct {
    Tpl *tpl;
    int64_t *tid, *off, **ranks, *sizes;
    int32_t *map, *rounds_of;
    Py_ssize_t ninst, items, nchunks, chunk_cap;
    uint64_t *chunks;
    int waves, qb, ib, rb, lb, db, sb, lvb, wvb, total;
    int64_t stop;
    Fill *f;
} Items;

static int add_chunk(Items *it, uint64_t key) {
    if (it->nchunks == it->chunk_cap) {
        it->chunk_cap *= 2;
        uint64_t *x = realloc(it->chunks, it->chunk_cap * sizeof(uint64_t));
        if (!x) { PyErr_NoMemory(); return -1; }
        it->chunks = x;
    }
    it->chunks[it->nchunks++] = key;
    return 0;
}

/* The items as keys of type T (fields packed from the least significant bit: message, instance,
 * dst, src, level, wave), sorted, then runs of equal (wave, level, src, dst) first fit.  Returns
 * 0, 1 where an item would land in a round >= stop, -1 on an error (set). */
#define FIT_ITEMS(name, T, SORT)                                                                \
static int name(Items *it) {                                                                    \
    T *keys = malloc((it->items + 1) * sizeof(T));                                              \
    if (!keys) { PyErr_NoMemory(); return -1; }                                                 \
    Py_ssize_t j = 0;                                                                           \
    for (Py_ssize_t i = 0; i < it->ninst; i++) {                                                \
        Tpl *t = &it->tpl[it->tid[i]];                                                          \
        const int64_t *rk = it->ranks[i];                                                       \
        const T base = (T)i << it->qb;                                                          \
        const int64_t shift = t->rounds ? i % t->rounds : 0;                                    \
        for (Py_ssize_t q = 0; q < t->n; q++) {                                                 \
            T wave = 0;                                                                         \
            if (it->waves) {                                                                    \
                int64_t w = t->k[q] + shift;                                                    \
                wave = (T)(w >= t->rounds ? w - t->rounds : w);                                 \
            }                                                                                   \
            keys[j++] = wave << it->wvb | (T)t->lv[q] << it->lvb | (T)it->map[rk[t->s[q]]] << it->sb \
                        | (T)it->map[rk[t->d[q]]] << it->db | base | (T)q;                      \
        }                                                                                       \
    }                                                                                           \
    /* made in (instance, message) order: a stable sort by the bits above them suffices */    \
    if (SORT(keys, it->items, it->db, it->total) < 0) { free(keys); return -1; }                \
    const T qmask = ((T)1 << it->qb) - 1, imask = ((T)1 << it->ib) - 1,                        \
            rmask = ((T)1 << it->rb) - 1, lmask = ((T)1 << it->lb) - 1;                         \
    int status = 0;                                                                             \
    j = 0;                                                                                      \
    while (j < it->items) {                                                                     \
        Py_ssize_t end = j + 1;                                                                 \
        const T head = keys[j] >> it->db;       /* (wave, level, src, dst): a run shares it */ \
        while (end < it->items && (keys[end] >> it->db) == head) end++;                         \
        Py_ssize_t lv = (Py_ssize_t)((keys[j] >> it->lvb) & lmask);                             \
        Py_ssize_t a = (Py_ssize_t)((keys[j] >> it->sb) & rmask), b = (Py_ssize_t)(head & rmask); \
        int64_t n = it->sizes[lv];                                                              \
        while (j < end) {                                                                       \
            int64_t got;                                                                        \
            Py_ssize_t k = fill_one(it->f, a, b, lv, n, end - j, it->stop, &got);               \
            if (k == -1) { status = 1; goto out; }                                              \
            if (k < 0) { status = -1; goto out; }                                               \
            if (k >= ((Py_ssize_t)1 << 21)) {                                                   \
                PyErr_SetString(PyExc_OverflowError, "place: too many rounds");                 \
                status = -1;                                                                    \
                goto out;                                                                       \
            }                                                                                   \
            if (add_chunk(it, (uint64_t)k << (2 * it->rb) | (uint64_t)a << it->rb | (uint64_t)b) < 0) { \
                status = -1;                                                                    \
                goto out;                                                                       \
            }                                                                                   \
            for (Py_ssize_t x = j; x < j + got; x++)                                            \
                it->rounds_of[it->off[(Py_ssize_t)((keys[x] >> it->qb) & imask)]                \
                              + (Py_ssize_t)(keys[x] & qmask)] = (int32_t)k;                    \
            j += got;                                                                           \
        }                                                                                       \
    }                                                                                           \
out:                                                                                            \
    free(keys);                                                                                 \
    return status;                                                                              \
}

FIT_ITEMS(fit_items64, uint64_t, radix64)
FIT_ITEMS(fit_items128, u128, radix128)

PyDoc_STRVAR(place_doc,
"place(templates, instances, sizes, budget, waves, stop, span[, wide]) -> None | (placement, rounds, messages, ranks, sent, received)\n\n"
"The templated placement of placement._fit: ``templates`` a list of (srcs, dsts, levels, rounds of\n"
"its messages, its own rounds), ``instances`` a list of (template id, ranks); ``sizes[level]`` the\n"
"bytes of a level (levels in order of size descending).  Items (wave, level, src rank, dst rank,\n"
"instance, message) sorted, runs of equal (wave, level, src, dst) first fit; the wave of message q\n"
"of instance i is (its round + i) mod its template's rounds (``waves``), else 0.  None when an\n"
"item would land in a round >= ``stop`` (stop < 0: no limit).  Else per instance the round of\n"
"each message, the rounds, the number of distinct (round, src, dst), the ranks in increasing\n"
"order, and the bytes each stages to send and to receive per round: int64 bytes, rank-major\n"
"(``rounds`` values a rank, the ranks in that order).  ``wide``: 128-bit keys even where 64 bits\n"
"hold the items (tests).");

static PyObject *place(PyObject *self, PyObject *args) {
    PyObject *otpl, *oinst, *osizes;
    long long budget, stop, span;
    int waves, wide = 0;
    if (!PyArg_ParseTuple(args, "OOOLpLL|p", &otpl, &oinst, &osizes, &budget, &waves, &stop, &span, &wide))
        return NULL;
    PyObject *result = NULL, *ftpl = NULL, *finst = NULL;
    Tpl *tpl = NULL;
    Py_ssize_t ntpl = 0, ninst = 0, nsizes = 0, nall = 0;
    int64_t *sizes = NULL, *tid = NULL, *allranks = NULL, *off = NULL;
    int64_t **ranks = NULL;
    Py_ssize_t *nrk = NULL;
    int32_t *map = NULL, *rounds_of = NULL;
    uint64_t *chunks = NULL;
    Fill f;
    memset(&f, 0, sizeof(f));
    if (stop < 0) stop = INT64_MAX;
    if (budget <= 0 || span <= 0) { PyErr_SetString(PyExc_ValueError, "place: budget and span must be positive"); goto done; }
    if (!(sizes = as_int64s(osizes, &nsizes, "sizes"))) goto done;
    for (Py_ssize_t i = 0; i < nsizes; i++)
        if (sizes[i] <= 0 || sizes[i] > budget) {
            PyErr_Format(PyExc_ValueError, "place: level %zd is %lld bytes (budget %lld)", i, (long long)sizes[i], budget);
            goto done;
        }
    if (nsizes >= (1 << 20)) { PyErr_SetString(PyExc_OverflowError, "place: too many levels"); goto done; }
    /* templates */
    if (!(ftpl = PySequence_Fast(otpl, "templates"))) goto done;
    ntpl = PySequence_Fast_GET_SIZE(ftpl);
    tpl = calloc(ntpl ? ntpl : 1, sizeof(Tpl));
    if (!tpl) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t t = 0; t < ntpl; t++) {
        PyObject *o = PySequence_Fast_GET_ITEM(ftpl, t), *os, *od, *ol, *ok;
        long long nr;
        if (!PyArg_ParseTuple(o, "OOOOL", &os, &od, &ol, &ok, &nr)) goto done;
        Py_ssize_t a, b, c, e;
        if (!(tpl[t].s = as_int64s(os, &a, "srcs")) || !(tpl[t].d = as_int64s(od, &b, "dsts"))
            || !(tpl[t].lv = as_int64s(ol, &c, "levels")) || !(tpl[t].k = as_int64s(ok, &e, "rounds")))
            goto done;
        if (a != b || a != c || a != e || (a && nr <= 0)) {
            PyErr_Format(PyExc_ValueError, "place: template %zd's message lists differ in length", t);
            goto done;
        }
        if (a >= (1 << 20)) { PyErr_SetString(PyExc_OverflowError, "place: a template has too many messages"); goto done; }
        tpl[t].n = a;
        tpl[t].rounds = nr;
        for (Py_ssize_t q = 0; q < a; q++) {
            if (tpl[t].lv[q] < 0 || tpl[t].lv[q] >= nsizes || tpl[t].s[q] < 0 || tpl[t].d[q] < 0
                || tpl[t].k[q] < 0 || tpl[t].k[q] >= nr) {
                PyErr_Format(PyExc_ValueError, "place: template %zd message %zd out of range", t, q);
                goto done;
            }
        }
    }
    /* instances */
    if (!(finst = PySequence_Fast(oinst, "instances"))) goto done;
    ninst = PySequence_Fast_GET_SIZE(finst);
    if (ninst >= (1 << 20)) { PyErr_SetString(PyExc_OverflowError, "place: too many instances"); goto done; }
    tid = malloc((ninst + 1) * sizeof(int64_t));
    off = malloc((ninst + 1) * sizeof(int64_t));
    ranks = calloc(ninst + 1, sizeof(int64_t *));
    nrk = calloc(ninst + 1, sizeof(Py_ssize_t));
    if (!tid || !off || !ranks || !nrk) { PyErr_NoMemory(); goto done; }
    Py_ssize_t items = 0;
    for (Py_ssize_t i = 0; i < ninst; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(finst, i), *orank;
        long long t;
        if (!PyArg_ParseTuple(o, "LO", &t, &orank)) goto done;
        if (t < 0 || t >= ntpl) { PyErr_Format(PyExc_ValueError, "place: instance %zd names template %lld", i, t); goto done; }
        tid[i] = t;
        if (!(ranks[i] = as_int64s(orank, &nrk[i], "ranks"))) goto done;
        for (Py_ssize_t q = 0; q < tpl[t].n; q++)
            if (tpl[t].s[q] >= nrk[i] || tpl[t].d[q] >= nrk[i]) {
                PyErr_Format(PyExc_ValueError, "place: instance %zd has %zd ranks, its template names index %lld",
                             i, nrk[i], (long long)(tpl[t].s[q] > tpl[t].d[q] ? tpl[t].s[q] : tpl[t].d[q]));
                goto done;
            }
        off[i] = items;
        items += tpl[t].n;
        nall += nrk[i];
    }
    off[ninst] = items;
    allranks = malloc((nall + 1) * sizeof(int64_t));
    if (!allranks) { PyErr_NoMemory(); goto done; }
    nall = 0;
    for (Py_ssize_t i = 0; i < ninst; i++) {
        memcpy(allranks + nall, ranks[i], nrk[i] * sizeof(int64_t));
        nall += nrk[i];
    }
    Py_ssize_t msize, nranks;
    if (!(map = dense_map(allranks, nall, &msize, &nranks))) goto done;
    if (msize > span) { PyErr_SetString(PyExc_ValueError, "place: a rank is not below span"); goto done; }
    if (nranks >= ((Py_ssize_t)1 << 21)) { PyErr_SetString(PyExc_OverflowError, "place: too many ranks"); goto done; }
    /* the items, sorted: one 128-bit key each, the fields packed from the least significant
     * bit as narrow as their largest value allows (message, instance, dst, src, level, wave):
     * an LSD radix sort passes only over the bits in use */
    int64_t maxq = 0, maxwave = 0;
    for (Py_ssize_t t = 0; t < ntpl; t++) {
        if (tpl[t].n > maxq) maxq = tpl[t].n;
        if (waves && tpl[t].n && tpl[t].rounds > maxwave) maxwave = tpl[t].rounds;
    }
    const int qb = bitlen(maxq), ib = bitlen(ninst), rb = bitlen(nranks), lb = bitlen(nsizes), wb = bitlen(maxwave);
    const int db = qb + ib, sb = db + rb, lvb = sb + rb, wvb = lvb + lb, total = wvb + wb;
    if (total > 128) { PyErr_SetString(PyExc_OverflowError, "place: items too wide for 128 bits"); goto done; }
    rounds_of = malloc((items + 1) * sizeof(int32_t));
    if (!rounds_of) { PyErr_NoMemory(); goto done; }
    if (fill_init(&f, budget, nranks, nsizes, 1) < 0) goto done;
    Items it = {tpl, tid, off, ranks, sizes, map, rounds_of, ninst, items, 0, items / 4 + 16, NULL,
                waves, qb, ib, rb, lb, db, sb, lvb, wvb, total, stop, &f};
    if (!(it.chunks = chunks = malloc(it.chunk_cap * sizeof(uint64_t)))) { PyErr_NoMemory(); goto done; }
    int status = total <= 64 && !wide ? fit_items64(&it) : fit_items128(&it);
    chunks = it.chunks;
    if (status < 0) goto done;
    if (status == 1) { result = Py_None; Py_INCREF(result); goto done; }
    Py_ssize_t nchunks = it.nchunks;
    /* messages: the distinct (round, src, dst) of the chunks */
    if (radix64(chunks, nchunks, 0, 2 * rb + bitlen(f.rounds)) < 0) goto done;
    Py_ssize_t messages = 0;
    for (Py_ssize_t c = 0; c < nchunks; c++)
        if (c == 0 || chunks[c] != chunks[c - 1]) messages++;
    /* results */
    {
        Py_ssize_t R = f.rounds;
        PyObject **ints = calloc(R + 1, sizeof(PyObject *));
        PyObject *rows = NULL, *sends = NULL, *recvs = NULL, *ranklist = NULL;
        if (!ints) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t k = 0; k < R; k++)
            if (!(ints[k] = PyLong_FromSsize_t(k))) goto fail;
        if (!(rows = PyList_New(ninst))) goto fail;
        for (Py_ssize_t i = 0; i < ninst; i++) {
            Py_ssize_t n = off[i + 1] - off[i];
            PyObject *row = PyList_New(n);
            if (!row) goto fail;
            for (Py_ssize_t q = 0; q < n; q++) {
                PyObject *v = ints[rounds_of[off[i] + q]];
                Py_INCREF(v);
                PyList_SET_ITEM(row, q, v);
            }
            PyList_SET_ITEM(rows, i, row);
        }
        /* staging per (rank, round), sends and receives apart: rank-major int64 bytes, R a rank,
         * the ranks in increasing order */
        if (!(ranklist = PyList_New(nranks))) goto fail;
        for (Py_ssize_t r = 0; r < msize; r++)
            if (map[r] >= 0) {
                PyObject *v = PyLong_FromSsize_t(r);
                if (!v) goto fail;
                PyList_SET_ITEM(ranklist, map[r], v);
            }
        if (!(sends = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nranks * R * sizeof(int64_t))))
            || !(recvs = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nranks * R * sizeof(int64_t)))))
            goto fail;
        int64_t *ps = (int64_t *)PyBytes_AS_STRING(sends), *pr = (int64_t *)PyBytes_AS_STRING(recvs);
        for (Py_ssize_t r = 0; r < nranks; r++)
            for (Py_ssize_t k = 0; k < R; k++) {
                int64_t u = f.used[r * f.cap + k], sv = f.sent[r * f.cap + k];
                ps[r * R + k] = sv;
                pr[r * R + k] = u - sv;
            }
        result = Py_BuildValue("NnnNNN", rows, R, messages, ranklist, sends, recvs);
        rows = sends = recvs = ranklist = NULL;
    fail:
        Py_XDECREF(rows);
        Py_XDECREF(sends);
        Py_XDECREF(recvs);
        Py_XDECREF(ranklist);
        for (Py_ssize_t k = 0; k < R; k++) Py_XDECREF(ints[k]);
        free(ints);
    }
done:
    if (tpl) {
        for (Py_ssize_t t = 0; t < ntpl; t++) { free(tpl[t].s); free(tpl[t].d); free(tpl[t].lv); free(tpl[t].k); }
        free(tpl);
    }
    if (ranks) for (Py_ssize_t i = 0; i < ninst; i++) free(ranks[i]);
    free(ranks); free(nrk); free(tid); free(off); free(sizes); free(allranks); free(map); free(rounds_of);
    free(chunks);
    fill_free(&f);
    Py_XDECREF(ftpl);
    Py_XDECREF(finst);
    return result;
}

static PyMethodDef methods[] = {
    {"fit_runs", fit_runs, METH_VARARGS, fit_runs_doc},
    {"fit_copies", fit_copies, METH_VARARGS, fit_copies_doc},
    {"entries", entries, METH_VARARGS, entries_doc},
    {"place", place, METH_VARARGS, place_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cfit", "First fit under a per-rank budget (the planner's hot loop), in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__cfit(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", CFIT_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
