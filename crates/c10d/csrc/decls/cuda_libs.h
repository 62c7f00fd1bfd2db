// Declarations, not CUDA's libraries: ProcessGroupNCCL.hpp reaches ATen/cuda/CUDAContext.h, which
// includes cuBLAS, cuSPARSE and cuSOLVER headers (hundreds of MB of wheels) for handle and status
// types it only names. Opaque handles and status enums, as those headers declare them, are all
// that parsing needs; nothing here changes a class layout (handles are pointers).
#pragma once
typedef struct cublasContext* cublasHandle_t;
typedef struct cublasLtContext* cublasLtHandle_t;
typedef struct cusparseContext* cusparseHandle_t;
typedef struct cusolverDnContext* cusolverDnHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;
typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;
typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;
