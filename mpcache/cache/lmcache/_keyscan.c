/* The token list of an LMCache key frame, straight from msgpack bytes into int64s (optional).
 *
 *   split_key(frame, max_tokens) -> (rest, tokens) | None
 *
 * A key frame is one msgpack map whose values are scalars, one of them the
 * "token_ids" array.  split_key scans the frame once: it checks the map, finds
 * the array, reads every element into a little-endian int64 (each must be an
 * integer in 0..2**63-1) and returns the frame with that array replaced by nil
 * (``rest``, a few dozen bytes for msgpack to decode) and the tokens' int64
 * bytes.  Anything else — another top-level type, a key that is not a string,
 * a container or extension among the other values, a second "token_ids", an
 * element that is not such an integer, more than max_tokens elements,
 * truncation, trailing bytes — returns None: the caller then decodes the whole
 * frame the ordinary way, whose checks name the problem.  So this file refuses
 * nothing by itself and cannot disagree with those checks on what is accepted;
 * mpcache.cache.lmcache.keyscan has the same function in Python, and a
 * differential test holds the two to the same answer, byte for byte.
 *
 * LMCache sends a request's token list in the key of every operation, in
 * frames that otherwise differ (the lookup's, each rank's prepare_store and
 * prepare_retrieve), so the last few token arrays read are kept, as their
 * msgpack bytes and their int64s: an array whose bytes start the same way as
 * a kept one is that array (a msgpack encoding is one value, read the same
 * way every time), found with one memcmp instead of a read per token.  It is
 * reused only for a frame with the same cache_salt.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tokens are little-endian int64; this build falls back to the Python scanner"
#endif

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Cursor;

static int need(Cursor *c, Py_ssize_t n) { return n >= 0 && c->end - c->p >= n; }

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* A big-endian length of n bytes after the type byte; -1 when truncated. */
static Py_ssize_t length(Cursor *c, int n) {
    if (!need(c, n)) return -1;
    uint64_t v = be(c->p, n);
    c->p += n;
    if (v > (uint64_t)PY_SSIZE_T_MAX) return -1;
    return (Py_ssize_t)v;
}

/* Skip one scalar (nil, bool, int, float, str, bin); 0 ok, -1 anything else or truncated. */
static int skip_scalar(Cursor *c) {
    if (!need(c, 1)) return -1;
    unsigned char t = *c->p++;
    Py_ssize_t n;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return 0;
    if (t >= 0xa0 && t <= 0xbf) n = t & 0x1f;
    else switch (t) {
        case 0xcc: case 0xd0: n = 1; break;
        case 0xcd: case 0xd1: n = 2; break;
        case 0xce: case 0xd2: case 0xca: n = 4; break;
        case 0xcf: case 0xd3: case 0xcb: n = 8; break;
        case 0xd9: case 0xc4: n = length(c, 1); break;
        case 0xda: case 0xc5: n = length(c, 2); break;
        case 0xdb: case 0xc6: n = length(c, 4); break;
        default: return -1;  /* array, map, ext, or the never-used 0xc1 */
    }
    if (!need(c, n)) return -1;
    c->p += n;
    return 0;
}

/* A string key; sets *key and *n, 0 ok, -1 not a string or truncated. */
static int read_str(Cursor *c, const unsigned char **key, Py_ssize_t *n) {
    if (!need(c, 1)) return -1;
    unsigned char t = *c->p++;
    if (t >= 0xa0 && t <= 0xbf) *n = t & 0x1f;
    else if (t == 0xd9) *n = length(c, 1);
    else if (t == 0xda) *n = length(c, 2);
    else if (t == 0xdb) *n = length(c, 4);
    else return -1;
    if (!need(c, *n)) return -1;
    *key = c->p;
    c->p += *n;
    return 0;
}

/* One token: an integer in 0..2**63-1 in any msgpack integer form; 0 ok, -1 otherwise. */
static int read_token(Cursor *c, int64_t *out) {
    if (!need(c, 1)) return -1;
    unsigned char t = *c->p++;
    if (t <= 0x7f) { *out = t; return 0; }
    int n;
    int is_signed;
    switch (t) {
        case 0xcc: n = 1; is_signed = 0; break;
        case 0xcd: n = 2; is_signed = 0; break;
        case 0xce: n = 4; is_signed = 0; break;
        case 0xcf: n = 8; is_signed = 0; break;
        case 0xd0: n = 1; is_signed = 1; break;
        case 0xd1: n = 2; is_signed = 1; break;
        case 0xd2: n = 4; is_signed = 1; break;
        case 0xd3: n = 8; is_signed = 1; break;
        default: return -1;
    }
    if (!need(c, n)) return -1;
    uint64_t v = be(c->p, n);
    c->p += n;
    if (is_signed) {
        if (v >> (8 * n - 1)) return -1;  /* negative */
    } else if (v > (uint64_t)INT64_MAX) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* The token_ids array at c->p as new little-endian int64 bytes in *tokens: 0, -1 when it is not the regular
 * case, -2 with an exception set. */
static int read_array(Cursor *c, Py_ssize_t max_tokens, PyObject **tokens) {
    if (!need(c, 1)) return -1;
    unsigned char a = *c->p++;
    Py_ssize_t count;
    if (a >= 0x90 && a <= 0x9f) count = a & 0x0f;
    else if (a == 0xdc) count = length(c, 2);
    else if (a == 0xdd) count = length(c, 4);
    else return -1;
    if (count < 0 || count > max_tokens || !need(c, count)) return -1;  /* each element is >= 1 byte */
    *tokens = PyBytes_FromStringAndSize(NULL, count * 8);
    if (*tokens == NULL) return -2;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(*tokens);
    for (Py_ssize_t k = 0; k < count; k++) {
        if (read_token(c, &out[k]) < 0) {
            Py_CLEAR(*tokens);
            return -1;
        }
    }
    return 0;
}

#define KEPT_ARRAYS 4
#define MAX_KEPT_TOKENS (1 << 17)  /* a longer array (past a 128 Ki-token context) is read each time, not kept */
static PyObject *kept_encoded[KEPT_ARRAYS];  /* bytes: a token_ids array as it came, every token valid */
static PyObject *kept_salt[KEPT_ARRAYS];     /* bytes: its frame's cache_salt value as it came (b"" without) */
static PyObject *kept_tokens[KEPT_ARRAYS];   /* bytes: its int64s */
static int kept_next;

/* Which kept arrays the bytes at c->p start with, one bit each; *n their length (a msgpack value is never
 * a prefix of another, so every match is the same array). */
static unsigned kept_matches(const Cursor *c, Py_ssize_t max_tokens, Py_ssize_t *n) {
    unsigned matches = 0;
    for (int i = 0; i < KEPT_ARRAYS; i++) {
        PyObject *encoded = kept_encoded[i];
        if (encoded != NULL && need(c, PyBytes_GET_SIZE(encoded)) &&
            memcmp(c->p, PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded)) == 0 &&
            PyBytes_GET_SIZE(kept_tokens[i]) / 8 <= max_tokens) {
            matches |= 1u << i;
            *n = PyBytes_GET_SIZE(encoded);
        }
    }
    return matches;
}

/* Whether kept array i came with this cache_salt encoding: a tenant's token list is reused for that tenant
 * only, so how fast a frame is read tells nobody what another salt sent. */
static int same_salt(int i, const unsigned char *salt_at, const unsigned char *salt_end) {
    Py_ssize_t n = salt_end - salt_at;
    return PyBytes_GET_SIZE(kept_salt[i]) == n && (n == 0 || memcmp(PyBytes_AS_STRING(kept_salt[i]), salt_at, n) == 0);
}

/* Keep a validated array, its frame's salt and its int64s, the oldest out (not kept if memory runs short). */
static void keep_array(const unsigned char *array_at, const unsigned char *array_end, const unsigned char *salt_at,
                       const unsigned char *salt_end, PyObject *tokens) {
    if (PyBytes_GET_SIZE(tokens) / 8 > MAX_KEPT_TOKENS)
        return;
    PyObject *encoded = PyBytes_FromStringAndSize((const char *)array_at, array_end - array_at);
    PyObject *salt = PyBytes_FromStringAndSize((const char *)salt_at, salt_end - salt_at);
    if (encoded == NULL || salt == NULL) {
        PyErr_Clear();
        Py_XDECREF(encoded);
        Py_XDECREF(salt);
        return;
    }
    Py_XSETREF(kept_encoded[kept_next], encoded);
    Py_XSETREF(kept_salt[kept_next], salt);
    Py_XSETREF(kept_tokens[kept_next], Py_NewRef(tokens));
    kept_next = (kept_next + 1) % KEPT_ARRAYS;
}

PyDoc_STRVAR(split_key_doc,
"split_key(frame, max_tokens, /) -> (rest, tokens) | None\n\n"
"The key map with its token_ids array replaced by nil, and the tokens as little-endian int64 bytes;\n"
"None when the frame is not that regular case (decode it the ordinary way).");

static PyObject *split_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "split_key takes (frame, max_tokens)");
        return NULL;
    }
    Py_ssize_t max_tokens = PyLong_AsSsize_t(args[1]);
    if (max_tokens == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *start = view.buf;
    Cursor c = {start, start + view.len};
    const unsigned char *array_at = NULL, *array_end = NULL, *salt_at = NULL, *salt_end = NULL;
    Py_ssize_t entries;
    unsigned kept = 0;  /* the kept arrays this frame's is */
    Py_ssize_t kept_len = 0;
    PyObject *tokens = NULL, *rest = NULL, *result = NULL;

    if (!need(&c, 1)) goto decline;
    unsigned char t = *c.p++;
    if (t >= 0x80 && t <= 0x8f) entries = t & 0x0f;
    else if (t == 0xde) entries = length(&c, 2);
    else if (t == 0xdf) entries = length(&c, 4);
    else goto decline;
    if (entries < 0) goto decline;
    for (Py_ssize_t i = 0; i < entries; i++) {
        const unsigned char *key;
        Py_ssize_t key_len;
        if (read_str(&c, &key, &key_len) < 0) goto decline;
        if (key_len != 9 || memcmp(key, "token_ids", 9) != 0) {
            int is_salt = key_len == 10 && memcmp(key, "cache_salt", 10) == 0;
            const unsigned char *value_at = c.p;
            if (skip_scalar(&c) < 0) goto decline;
            if (is_salt) {
                salt_at = value_at;
                salt_end = c.p;
            }
            continue;
        }
        if (array_at != NULL) goto decline;  /* a second token_ids */
        array_at = c.p;
        kept = kept_matches(&c, max_tokens, &kept_len);
        if (kept) {
            c.p += kept_len;
        } else {
            int read = read_array(&c, max_tokens, &tokens);
            if (read == -1) goto decline;
            if (read == -2) goto done;
        }
        array_end = c.p;
    }
    if (array_at == NULL || c.p != c.end) goto decline;
    int reused = 0;
    for (int i = 0; i < KEPT_ARRAYS && !reused; i++) {
        if ((kept >> i & 1) && same_salt(i, salt_at, salt_end)) {
            tokens = Py_NewRef(kept_tokens[i]);
            reused = 1;
        }
    }
    if (!reused) {
        if (tokens == NULL) {  /* kept only with another salt: read as if never seen */
            Cursor array = {array_at, array_end};
            int read = read_array(&array, max_tokens, &tokens);
            if (read == -1) goto decline;  /* not expected: these bytes were read as an array before */
            if (read == -2) goto done;
        }
        keep_array(array_at, array_end, salt_at, salt_end, tokens);
    }
    Py_ssize_t before = array_at - start, after = c.end - array_end;
    rest = PyBytes_FromStringAndSize(NULL, before + 1 + after);
    if (rest == NULL) goto done;
    char *r = PyBytes_AS_STRING(rest);
    memcpy(r, start, before);
    r[before] = (char)0xc0;
    memcpy(r + before + 1, array_end, after);
    result = PyTuple_Pack(2, rest, tokens);
    goto done;

decline:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(rest);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"split_key", (PyCFunction)(void (*)(void))split_key, METH_FASTCALL, split_key_doc},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mpcache.cache.lmcache._keyscan",
    "The token list of an LMCache key frame, straight from msgpack into int64 (see keyscan.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__keyscan(void) { return PyModule_Create(&module); }
