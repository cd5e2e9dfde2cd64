// Default implementations of the optional parts of the driver seam.
#include "torpor/driver.hpp"

#include "torpor/error.hpp"

namespace torpor {

int Driver::multicast_export_fd(MulticastHandle) {
  throw_driver_error(static_cast<int>(driver_status::not_supported), "cuMemExportToShareableHandle(multicast)",
                     "this driver cannot share multicast objects");
}

MulticastHandle Driver::multicast_import_fd(int) {
  throw_driver_error(static_cast<int>(driver_status::not_supported), "cuMemImportFromShareableHandle(multicast)",
                     "this driver cannot share multicast objects");
}

}  // namespace torpor
