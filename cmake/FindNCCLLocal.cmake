# Finds NCCL >= 2.28.9 (the device API with symmetric windows). NCCL_ROOT overrides the search.
# Defines the imported target NCCL::nccl and NCCL_LIBRARY_DIR.
if(TARGET NCCL::nccl)
  return()
endif()
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda /usr)
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints}
             PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  message(FATAL_ERROR "epmoe: NCCL not found. Set NCCL_ROOT to a directory with include/nccl.h "
                      "and lib/libnccl.so (NCCL >= 2.28.9).")
endif()
file(STRINGS ${NCCL_INCLUDE_DIR}/nccl.h _nccl_code REGEX "^#define NCCL_VERSION_CODE")
string(REGEX MATCH "[0-9]+" NCCL_VERSION_CODE "${_nccl_code}")
if(NCCL_VERSION_CODE LESS 22809)
  message(FATAL_ERROR "epmoe: NCCL at ${NCCL_INCLUDE_DIR} has version code ${NCCL_VERSION_CODE}; "
                      "need >= 22809 (2.28.9) for symmetric windows and the device API. Set NCCL_ROOT.")
endif()
get_filename_component(NCCL_LIBRARY_DIR ${NCCL_LIBRARY} DIRECTORY)
add_library(NCCL::nccl SHARED IMPORTED)
set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                      INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
message(STATUS "epmoe: NCCL ${NCCL_VERSION_CODE} at ${NCCL_LIBRARY}")
