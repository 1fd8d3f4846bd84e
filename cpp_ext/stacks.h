// This thread's saved-tensor hook stack and torch function mode stack, read from C++ (torch's
// Python API has no query for either). See stacks.cpp.
#pragma once
#include <Python.h>

namespace actnn_zoo {

// Whether `pack` is the innermost saved-tensor pack hook and the default hooks run (not
// deferred while dynamo traces, not disabled): what a save made now reaches first.
bool saved_hooks_top_is(PyObject* pack);

}  // namespace actnn_zoo
