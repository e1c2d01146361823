/* The token list of an LMCache key frame, straight from msgpack bytes into int64s (optional).
 *
 *   split_key(frame, max_tokens, kept) -> (rest, found, token_list, salt) | None
 *
 * A key frame is one msgpack map whose values are scalars, one of them the
 * token list: LMCache 0.5.6's "token_ids" (an array of integers) or 0.5.7's
 * "token_bytes" (a bin of big-endian uint32s).  split_key scans the frame
 * once: it checks the map, finds the token list, reads every token into a
 * little-endian int64 (a token_ids element must be an integer in
 * 0..2**63-1, token_bytes whole 4-byte tokens) and returns the frame with the
 * token list replaced by nil (``rest``, a few dozen bytes for msgpack to
 * decode).  Anything else — another top-level type, a key that is not a
 * string, a container or extension among the other values, a second token
 * list, an element that is not such an integer, more than max_tokens tokens,
 * truncation, trailing bytes — returns None: the caller then decodes the whole
 * frame the ordinary way, whose checks name the problem.  So this file refuses
 * nothing by itself and cannot disagree with those checks on what is accepted;
 * mpcache.cache.lmcache.keyscan has the same function in Python, and a
 * differential test holds the two to the same answer, byte for byte.
 *
 * ``kept`` is a tuple of (salt, token_list) byte pairs that split_key returned
 * for earlier frames, chosen by their one owner (keycache.py).  Where this
 * frame's token list and cache_salt value are the bytes of one pair,
 * ``found`` is that pair's index and the list is not read again (one memcmp
 * instead of a read per token: a msgpack value is never a prefix of another,
 * so every pair matching at the list's position is that list), and
 * ``token_list`` and ``salt`` are None.  Otherwise ``found`` is the tokens
 * read, as int64 bytes, and ``token_list`` and ``salt`` this frame's
 * encodings of them (b"" without a cache_salt), for the owner to keep or not.
 * This file keeps nothing between calls.
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

/* The bin of token_bytes at c->p as new little-endian int64 bytes in *tokens: 0, -1 when it is not the regular case
 * (not a bin, not whole 4-byte tokens, over max_tokens, truncated), -2 with an exception set. */
static int read_bin(Cursor *c, Py_ssize_t max_tokens, PyObject **tokens) {
    if (!need(c, 1)) return -1;
    unsigned char t = *c->p++;
    Py_ssize_t n;
    if (t == 0xc4) n = length(c, 1);
    else if (t == 0xc5) n = length(c, 2);
    else if (t == 0xc6) n = length(c, 4);
    else return -1;
    if (n < 0 || n % 4 || n / 4 > max_tokens || !need(c, n)) return -1;
    *tokens = PyBytes_FromStringAndSize(NULL, n * 2);
    if (*tokens == NULL) return -2;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(*tokens);
    for (Py_ssize_t k = 0; k < n / 4; k++) {
        uint32_t v;
        memcpy(&v, c->p + 4 * k, 4);
        out[k] = (int64_t)__builtin_bswap32(v);  /* big-endian on a little-endian build (checked above) */
    }
    c->p += n;
    return 0;
}

#define MAX_KEPT 32  /* pairs in ``kept``: one bit each below */

enum { NO_LIST, ARRAY, BIN };

/* Which spelling of the token list a key names (token_ids: ARRAY, token_bytes: BIN), else NO_LIST. */
static int list_kind(const unsigned char *key, Py_ssize_t n) {
    if (n == 9 && memcmp(key, "token_ids", 9) == 0) return ARRAY;
    if (n == 11 && memcmp(key, "token_bytes", 11) == 0) return BIN;
    return NO_LIST;
}

/* The tokens an encoded list of this kind announces in its header; -1 when it is not of that kind. */
static Py_ssize_t announced(PyObject *encoded, int kind) {
    Cursor c = {(const unsigned char *)PyBytes_AS_STRING(encoded),
                (const unsigned char *)PyBytes_AS_STRING(encoded) + PyBytes_GET_SIZE(encoded)};
    if (!need(&c, 1)) return -1;
    unsigned char t = *c.p++;
    if (kind == ARRAY) {
        if (t >= 0x90 && t <= 0x9f) return t & 0x0f;
        if (t == 0xdc) return length(&c, 2);
        if (t == 0xdd) return length(&c, 4);
        return -1;
    }
    Py_ssize_t n = t == 0xc4 ? length(&c, 1) : t == 0xc5 ? length(&c, 2) : t == 0xc6 ? length(&c, 4) : -1;
    return n < 0 ? -1 : n / 4;
}

/* Which kept lists the bytes at c->p start with, one bit each; *n their length. */
static unsigned kept_matches(const Cursor *c, PyObject *kept, int kind, Py_ssize_t max_tokens, Py_ssize_t *n) {
    unsigned matches = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kept); i++) {
        PyObject *encoded = PyTuple_GET_ITEM(PyTuple_GET_ITEM(kept, i), 1);
        Py_ssize_t size = PyBytes_GET_SIZE(encoded);
        if (need(c, size) && memcmp(c->p, PyBytes_AS_STRING(encoded), size) == 0) {
            Py_ssize_t count = announced(encoded, kind);
            if (count >= 0 && count <= max_tokens) {
                matches |= 1u << i;
                *n = size;
            }
        }
    }
    return matches;
}

/* Whether kept pair i came with this cache_salt encoding. */
static int same_salt(PyObject *kept, Py_ssize_t i, const unsigned char *salt_at, const unsigned char *salt_end) {
    PyObject *salt = PyTuple_GET_ITEM(PyTuple_GET_ITEM(kept, i), 0);
    Py_ssize_t n = salt_end - salt_at;
    return PyBytes_GET_SIZE(salt) == n && (n == 0 || memcmp(PyBytes_AS_STRING(salt), salt_at, n) == 0);
}

/* 0 when kept is a tuple of at most MAX_KEPT (bytes, bytes) pairs, else -1 with TypeError set. */
static int check_kept(PyObject *kept) {
    if (PyTuple_Check(kept) && PyTuple_GET_SIZE(kept) <= MAX_KEPT) {
        Py_ssize_t i = 0;
        for (; i < PyTuple_GET_SIZE(kept); i++) {
            PyObject *pair = PyTuple_GET_ITEM(kept, i);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 0)) ||
                !PyBytes_Check(PyTuple_GET_ITEM(pair, 1)))
                break;
        }
        if (i == PyTuple_GET_SIZE(kept)) return 0;
    }
    PyErr_SetString(PyExc_TypeError, "split_key: kept must be a tuple of at most 32 (bytes, bytes) pairs");
    return -1;
}

static int read_list(Cursor *c, int kind, Py_ssize_t max_tokens, PyObject **tokens) {
    return kind == ARRAY ? read_array(c, max_tokens, tokens) : read_bin(c, max_tokens, tokens);
}

PyDoc_STRVAR(split_key_doc,
"split_key(frame, max_tokens, kept, /) -> (rest, found, token_list, salt) | None\n\n"
"The key map with its token list replaced by nil; found: the index of the kept (salt, token_list) pair the\n"
"frame repeats, or the tokens read as little-endian int64 bytes (then token_list and salt are the frame's\n"
"encodings of them). None when the frame is not that regular case (decode it the ordinary way).");

static PyObject *split_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "split_key takes (frame, max_tokens, kept)");
        return NULL;
    }
    Py_ssize_t max_tokens = PyLong_AsSsize_t(args[1]);
    if (max_tokens == -1 && PyErr_Occurred()) return NULL;
    PyObject *kept = args[2];
    if (check_kept(kept) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *start = view.buf;
    Cursor c = {start, start + view.len};
    const unsigned char *list_at = NULL, *list_end = NULL, *salt_at = NULL, *salt_end = NULL;
    int kind = NO_LIST;
    Py_ssize_t entries;
    unsigned matches = 0;  /* the kept lists this frame's is */
    Py_ssize_t match_len = 0;
    PyObject *tokens = NULL, *rest = NULL, *found = NULL, *encoded = NULL, *salt = NULL, *result = NULL;

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
        int which = list_kind(key, key_len);
        if (which == NO_LIST) {
            int is_salt = key_len == 10 && memcmp(key, "cache_salt", 10) == 0;
            const unsigned char *value_at = c.p;
            if (skip_scalar(&c) < 0) goto decline;
            if (is_salt) {
                salt_at = value_at;
                salt_end = c.p;
            }
            continue;
        }
        if (list_at != NULL) goto decline;  /* a second token list */
        list_at = c.p;
        kind = which;
        matches = kept_matches(&c, kept, kind, max_tokens, &match_len);
        if (matches) {
            c.p += match_len;
        } else {
            int read = read_list(&c, kind, max_tokens, &tokens);
            if (read == -1) goto decline;
            if (read == -2) goto done;
        }
        list_end = c.p;
    }
    if (list_at == NULL || c.p != c.end) goto decline;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kept) && found == NULL; i++) {
        if ((matches >> i & 1) && same_salt(kept, i, salt_at, salt_end)) {
            found = PyLong_FromSsize_t(i);
            if (found == NULL) goto done;
        }
    }
    if (found == NULL) {
        if (tokens == NULL) {  /* kept only with another salt: read as if never seen */
            Cursor list = {list_at, list_end};
            int read = read_list(&list, kind, max_tokens, &tokens);
            if (read == -1) goto decline;  /* not expected: these bytes were read as a token list before */
            if (read == -2) goto done;
        }
        encoded = PyBytes_FromStringAndSize((const char *)list_at, list_end - list_at);
        salt = PyBytes_FromStringAndSize((const char *)salt_at, salt_end - salt_at);
        if (encoded == NULL || salt == NULL) goto done;
    }
    Py_ssize_t before = list_at - start, after = c.end - list_end;
    rest = PyBytes_FromStringAndSize(NULL, before + 1 + after);
    if (rest == NULL) goto done;
    char *r = PyBytes_AS_STRING(rest);
    memcpy(r, start, before);
    r[before] = (char)0xc0;
    memcpy(r + before + 1, list_end, after);
    if (found != NULL) result = PyTuple_Pack(4, rest, found, Py_None, Py_None);
    else result = PyTuple_Pack(4, rest, tokens, encoded, salt);
    goto done;

decline:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(rest);
    Py_XDECREF(found);
    Py_XDECREF(encoded);
    Py_XDECREF(salt);
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
