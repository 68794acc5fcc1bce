/* actx.reader._row_copy: the Python module around row_copy.c's kernel, built at install time
   (setup.py's optional Extension; reader/storage/row_copy.py falls back to numpy without it).

   copy_rows(src, src_rows, dst, n, row_bytes) takes addresses (numpy's ctypes.data) and
   releases the GIL while it copies, so the stream's gather threads copy in parallel;
   dequantise_rows(...) is the same copy for a float8 hook, dequantised on the way. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

int actx_row_copy_version(void);
void actx_copy_rows(const char *src, const int64_t *src_rows, const int64_t *dst,
                    int64_t n, int64_t row_bytes);
void actx_dequantise_rows(const uint8_t *src, const int64_t *src_rows, const float *scales,
                          const int64_t *scale_rows, const int64_t *dst, int64_t n,
                          int64_t hidden, const float *table, int bfloat16);

static PyObject *copy_rows(PyObject *self, PyObject *args) {
  unsigned long long src, src_rows, dst;
  long long n, row_bytes;
  if (!PyArg_ParseTuple(args, "KKKLL", &src, &src_rows, &dst, &n, &row_bytes))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  actx_copy_rows((const char *)(uintptr_t)src, (const int64_t *)(uintptr_t)src_rows,
                 (const int64_t *)(uintptr_t)dst, (int64_t)n, (int64_t)row_bytes);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *dequantise_rows(PyObject *self, PyObject *args) {
  unsigned long long src, src_rows, scales, scale_rows, dst, table;
  long long n, hidden;
  int bfloat16;
  if (!PyArg_ParseTuple(args, "KKKKKLLKp", &src, &src_rows, &scales, &scale_rows, &dst, &n,
                        &hidden, &table, &bfloat16))
    return NULL;
  Py_BEGIN_ALLOW_THREADS
  actx_dequantise_rows((const uint8_t *)(uintptr_t)src, (const int64_t *)(uintptr_t)src_rows,
                       (const float *)(uintptr_t)scales, (const int64_t *)(uintptr_t)scale_rows,
                       (const int64_t *)(uintptr_t)dst, (int64_t)n, (int64_t)hidden,
                       (const float *)(uintptr_t)table, bfloat16);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *version(PyObject *self, PyObject *unused) {
  return PyLong_FromLong(actx_row_copy_version());
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(src, src_rows, dst, n, row_bytes): row src_rows[i] of src to dst[i] "
     "(all addresses), without the GIL."},
    {"dequantise_rows", dequantise_rows, METH_VARARGS,
     "dequantise_rows(src, src_rows, scales, scale_rows, dst, n, hidden, table, bfloat16): "
     "row src_rows[i] of the float8 bytes src, through table (float32 [256]) times "
     "scales[scale_rows[i]], to dst[i] as float32 or bfloat16 (all addresses), without "
     "the GIL."},
    {"version", version, METH_NOARGS, "ACTX_ROW_COPY_VERSION of the kernel."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_copy",
                                    "actx's row copy kernel (reader/native/row_copy.c).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__row_copy(void) { return PyModule_Create(&module); }
