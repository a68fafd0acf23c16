// Must not compile: remat options are a closed set.
#include <linum/linum.hpp>
using namespace linum;
struct Block {
  Array operator()(Scope&, const Array& x) const { return x; }
};
int main() {
  Tree vars;
  Array x = Array::zeros(Shape{2});
  (void)apply(lift::remat<Block, int>{}, vars, x);
}
